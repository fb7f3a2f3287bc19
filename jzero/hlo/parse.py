"""HLO text: a program's text, and its computations, instructions, shapes and device groups.

The parsing half of :mod:`jzero.hlo`; what is counted from it is :mod:`jzero.hlo.collective_bytes`
and
:mod:`jzero.hlo`'s schedule and layout readers.

Decisions:

* The optimized HLO is read as text (``compiled.as_text()``) with a few regular expressions:
  computations by their headers (:func:`computations`), instructions as ``name = shape
  op(operands)`` (``INSTR``, ``INSTR_NAME``, :func:`operand_names`), buffer bytes from the
  shapes' element types (:func:`shape_bytes`; tuples list every buffer). No XLA bindings are
  needed, and a saved text reads the same as a live program.
* Device groups (:func:`replica_groups`) are read in any of XLA's three spellings: explicit
  lists, iota ``[G,S]<=[dims]T(perm)``, and ``mesh[...] device_ids=... {axes}``.
* :func:`program_text` returns the program before the CPU backend widens 16-bit collectives
  to float32 (``all-reduce-promotion``), so the dtype jzero chose is what is read.
"""

from __future__ import annotations

import contextlib
import glob
import math
import os
import re
import tempfile
from collections.abc import Iterator
from typing import Any

import numpy as np

__all__ = ["KINDS", "program_text", "replica_groups"]

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")

DTYPE_BYTES = {
    "pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4,
    "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
    "f8e4m3fn": 1, "f8e5m2": 1,
}  # fmt: skip

SHAPE = re.compile(r"\b([a-z]+[0-9]*[a-z0-9]*)\[([0-9,]*)\]")

_HEADER = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*(?:\(.*\))?.*\{\s*$")

INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(.+?)\s+([a-z][a-z0-9\-]*)\((.*)$")

INSTR_NAME = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=")


def shape_bytes(text: str) -> list[int]:
    out = []
    for dtype, dims in SHAPE.findall(text):
        if dtype not in DTYPE_BYTES:
            continue
        n = math.prod(int(d) for d in dims.split(",") if d) if dims else 1
        out.append(n * DTYPE_BYTES[dtype])
    return out


def computations(text: str) -> tuple[dict[str, list[str]], str | None]:
    """The HLO text's computations (name -> instruction lines) and the entry's name."""
    comps: dict[str, list[str]] = {}
    entry = None
    current: list[str] | None = None
    for line in text.splitlines():
        if current is None:
            m = _HEADER.match(line)
            if m and not line.startswith(" "):
                current = comps.setdefault(m.group(1), [])
                if line.startswith("ENTRY"):
                    entry = m.group(1)
            continue
        if line.strip() == "}":
            current = None
            continue
        current.append(line)
    return comps, entry


def compiled_text(compiled: Any, *, tables: bool = False) -> str:
    """A compiled program's HLO text. ``tables``: with its constants printed whole where the
    running jaxlib allows (``as_text()`` elides a constant of more than 10 elements as
    ``{...}``; :mod:`jzero.hlo.collective_bytes` reads a pipeline's schedule table), asked for
    only where the elided text has a table to read, as whole constants can be large."""
    if isinstance(compiled, str):
        return compiled
    text = compiled.as_text()
    if not tables or "constant({...})" not in text or "branch_computations=" not in text:
        return text
    try:
        from jaxlib import _hlo  # the printer's options; absent or renamed in some jaxlibs

        options = _hlo.HloPrintOptions()
        options.print_large_constants = True
        modules = compiled.runtime_executable().hlo_modules()
        return "\n".join(m.to_string(options) for m in modules)
    except Exception:  # noqa: BLE001 - any failure: the elided text, tables counted as branches
        return text


def operand_names(rest: str) -> list[str]:
    depth, end = 1, len(rest)
    for i, ch in enumerate(rest):
        depth += ch == "("
        depth -= ch == ")"
        if depth == 0:
            end = i
            break
    return re.findall(r"%([\w.\-]+)", rest[:end])


def _iota(dims: str, perm: str | None) -> np.ndarray:
    shape = [int(d) for d in dims.split(",") if d]
    ids = np.arange(math.prod(shape)).reshape(shape)
    if perm:
        ids = ids.transpose([int(p) for p in perm.split(",")])
    return ids


def source_target_pairs(line: str) -> list[list[int]]:
    """A ``collective-permute``'s ``source_target_pairs={{0,4},{1,5}}`` as ``[[0, 4], [1, 5]]``:
    each pair is the group of devices that one transfer spans; empty when the line has none."""
    m = re.search(r"source_target_pairs=\{((?:\{[0-9,]*\},?)*)\}", line)
    if not m:
        return []
    return [[int(x) for x in g.split(",") if x] for g in re.findall(r"\{([0-9,]*)\}", m.group(1))]


def replica_groups(line: str, num_devices: int) -> list[list[int]]:
    """The device groups of one collective instruction, as lists of device ids.

    Reads the three spellings XLA prints: ``replica_groups={{0,1},{2,3}}``, the iota form
    ``replica_groups=[2,2]<=[4]`` (optionally ``T(1,0)``), and the mesh form
    ``replica_groups=mesh['a'=2,'b'=2], device_ids=([4]) {'a'}`` (groups along the axes in
    braces). An empty or absent list is one group of all ``num_devices``.
    """
    m = re.search(
        r"replica_groups=mesh\[([^\]]*)\](?:,\s*device_ids=\((.*?)\))?\s*\{([^}]*)\}", line
    )
    if m:
        axes = re.findall(r"'([^']+)'=(\d+)", m.group(1))
        names, sizes = [a for a, _ in axes], [int(n) for _, n in axes]
        ids_text = (m.group(2) or "").strip()
        iota = re.fullmatch(r"\[([0-9,]*)\](?:T\(([0-9,]*)\))?", ids_text)
        if iota:
            ids = _iota(iota.group(1), iota.group(2)).reshape(-1)
        elif ids_text:
            ids = np.array([int(x) for x in re.findall(r"\d+", ids_text)])
        else:
            ids = np.arange(math.prod(sizes))
        grid = ids.reshape(sizes)
        along = [names.index(a) for a in re.findall(r"'([^']+)'", m.group(3))]
        rest = [i for i in range(len(sizes)) if i not in along]
        size = math.prod(sizes[i] for i in along)
        return grid.transpose(rest + along).reshape(-1, size).tolist()
    m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([0-9,]*)\](?:T\(([0-9,]*)\))?", line)
    if m:
        groups, size = int(m.group(1)), int(m.group(2))
        return _iota(m.group(3), m.group(4)).reshape(groups, size).tolist()
    m = re.search(r"replica_groups=\{((?:\{[0-9,]*\},?)*)\}", line)
    if m:
        found = [
            [int(x) for x in g.split(",") if x] for g in re.findall(r"\{([0-9,]*)\}", m.group(1))
        ]
        found = [g for g in found if g]
        if found:
            return found
    return [list(range(num_devices))]


@contextlib.contextmanager
def _persistent_cache_off() -> Iterator[None]:
    """JAX's persistent compilation cache off for the compilations inside.

    The cache's key leaves out the dump options, so with the cache on (``jzero train`` turns it
    on) a program compiled before would be loaded from disk and dump nothing. JAX decides once
    whether the cache is used, at its next compilation: the decision is reset on the way in and
    on the way out."""
    import jax
    from jax.experimental.compilation_cache import compilation_cache

    if not jax.config.jax_compilation_cache_dir or not jax.config.jax_enable_compilation_cache:
        yield
        return
    jax.config.update("jax_enable_compilation_cache", False)
    compilation_cache.reset_cache()
    try:
        yield
    finally:
        jax.config.update("jax_enable_compilation_cache", True)
        compilation_cache.reset_cache()


def program_text(lowered: Any) -> str:
    """The HLO of a lowered step after SPMD partitioning, with the collectives' own dtypes.

    The CPU backend has no 16-bit collectives: after partitioning, its compiler widens each
    bf16/fp16 all-reduce, reduce-scatter and all-gather to float32 (``all-reduce-promotion``),
    so its final program would hide a 16-bit ``communication_data_type``. This returns the
    module just before that rewrite (the program jzero emits, as a GPU runs it); where the step
    is compiled with that pass off (:data:`jzero.comm.CPU_PARTLY_MANUAL_BF16_OPTIONS`), the
    module before ``float-normalization-bf16``, which widens them there; on backends without
    either rewrite it is the compiled program itself.

    Args:
      lowered: a ``jax.stages.Lowered`` (e.g. ``engine.lower(batch)``).

    Returns:
      HLO text for :func:`collectives`.
    """
    with tempfile.TemporaryDirectory() as tmp, _persistent_cache_off():
        # The module before the promotion's last run, or before the first normalization (a
        # later one comes after the collectives are widened).
        passes = {"all-reduce-promotion": -1, "float-normalization-bf16": 0}
        compiled = lowered.compile(
            compiler_options={"xla_dump_to": tmp, "xla_dump_hlo_pass_re": "|".join(passes)}
        )
        dumps = [
            found[which]
            for name, which in passes.items()
            if (found := sorted(glob.glob(os.path.join(tmp, f"*before_{name}.txt"))))
        ]
        if not dumps:
            return compiled.as_text()
        with open(dumps[0]) as f:
            return f.read()
