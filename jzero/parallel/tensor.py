"""Automatic tensor parallelism (DeepSpeed's AutoTP): a Megatron-style ``model``-axis spec for
every parameter, from its name and shape, with no change to the model.

:func:`autotp_specs` reads a params tree (arrays or ``jax.ShapeDtypeStruct``) and returns one
``PartitionSpec`` per leaf over the ``model`` axis, plus the rule that chose it. jzero then places
ZeRO's data axis on a dimension the spec leaves free (:mod:`jzero.parallel.zero.leaf_rule`), so
tensor parallelism composes with every stage; the compiler inserts the model-axis collectives
(Megatron's all-reduce after each row-parallel layer) from the shardings.

Decisions:

* **The rules** (Megatron-LM's split, the one DeepSpeed's AutoTP and torchtitan apply):
  column-parallel (the output features split: attention q/k/v, the MLP's up and gate
  projections, and their biases), row-parallel (the input features split: the attention
  output and the MLP's down projection; their biases replicated, added once after the
  all-reduce), vocabulary-parallel (the embedding's vocabulary rows, an untied head's
  vocabulary columns), replicated (norms, position tables). Kernels are read in Flax's
  ``(in, out)`` layout, with any leading stacked-layer dimensions: column-parallel splits the
  last dimension, row-parallel the one before it.
* **Names.** A leaf is matched by the deepest component of its dotted path that names a
  layer (``layers.0.self_attn.q_proj.weight`` -> ``q_proj``; ``blocks.attn_qkv_bias`` ->
  ``attn_qkv`` with role bias), against the spellings of Llama / Mistral / Qwen (``q_proj``,
  ``o_proj``, ``gate_proj``, ``up_proj``, ``down_proj``, ``embed_tokens``, ``lm_head``), GPT-2
  (``c_attn``, ``c_fc``, ``c_proj``, ``wte``), Meta's Llama (``wq``, ``wo``, ``w1``-``w3``,
  ``tok_embeddings``, ``output``), T5 (``q``, ``k``, ``v``, ``o``, ``wi``, ``wo``, ``shared``),
  BERT/Flax (``query``, ``key``, ``value``), OPT/BART (``fc1``, ``fc2``, ``out_proj``), and the
  built-in GPT (``attn_qkv``, ``attn_out``, ``mlp_in``, ``mlp_out``, ``embed.tokens``). Only the
  deepest component is read, so ``attention.output.dense`` is not mistaken for a head.
* **Flax's own attention** (``MultiHeadDotProductAttention``, NNX's ``MultiHeadAttention``)
  keeps ``query``/``key``/``value`` kernels ``(d, H, Dh)`` and an ``out`` kernel
  ``(H, Dh, d)``: found together, they are split on the heads dimension (q/k/v's and their
  biases', ``out``'s first), so attention runs on whole local heads.
* **A fused qkv leaf splits per head group, not per third.** A fused leaf with its q/k/v
  dimension of its own (``(..., d, 3, n)``, as the built-in GPT stores it) is split on ``n``:
  device ``j`` of the model axis holds the q, k and v columns of head group ``j``, so
  attention runs on local heads with no communication. A flat fused leaf ``(..., d, 3n)``
  (Hugging Face's GPT-2 ``c_attn``) cannot rest split per head under one ``PartitionSpec``
  (each device's columns would be three separate blocks), and a contiguous split would hand
  device 0 all of q: it stays replicated over ``model`` and is listed with the fix (store it
  as ``(d, 3, n)``, or a ``tp_plan`` entry).
* ``tensor_parallel.tp_plan`` (DeepSpeed's and Hugging Face's name) maps glob patterns of
  dotted paths (``"*.mlp.fc_in.*"``) to ``colwise``, ``rowwise``, ``vocab``, ``replicate`` or
  an explicit spec list; the first pattern that matches wins over the built-in rules, and a
  user's own annotations (``InitOptions.param_specs``, Flax sharding metadata) win over both.
* **From the program** (:mod:`jzero.rewrite.megatron`): a leaf no name rule matches takes the
  split the traced loss shows (Megatron's pair: a matmul output dimension that a second weight
  contracts; a gathered table's rows; an output head's vocabulary), so a model whose weights
  carry its author's own names (``q_einsum``, ``gating_einsum``, ``linear``) is split too.
  Names keep precedence, a ``tp_plan`` wins over both; the rule says which decided
  (``"column (from the program)"``). A pair the model-axis size does not divide stays
  replicated and is listed with the unmatched leaves (not an error: nothing named it).
* A leaf that no rule matched stays replicated over ``model``, and :func:`autotp_specs` says
  so in its rule (``engine.describe()`` lists those leaves once), never silently.
* A split dimension the model-axis size does not divide, or a head count it does not divide,
  is an error that names the leaf, the numbers and the fix: an uneven split would pad every
  activation and cannot give each device whole heads.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jax
from jax.sharding import PartitionSpec as P

from jzero._util import divisors, dotted
from jzero.rewrite import ProgramSplit

__all__ = ["MODEL_AXIS", "TPChoice", "autotp_specs", "unmatched"]

PyTree = Any

MODEL_AXIS = "model"
"""The mesh axis tensor parallelism splits layers over."""

_COLUMN = {
    "q_proj", "k_proj", "v_proj", "query", "key", "value", "q", "k", "v", "wq", "wk", "wv",
    "gate_proj", "up_proj", "w1", "w3", "fc1", "fc_in", "c_fc", "wi", "wi_0", "wi_1",
    "dense_h_to_4h", "mlp_in", "intermediate", "gate_up_proj",
}  # fmt: skip
_FUSED_QKV = {"c_attn", "qkv", "qkv_proj", "query_key_value", "wqkv", "attn_qkv", "in_proj"}
_ROW = {
    "o_proj", "out_proj", "o", "wo", "c_proj", "down_proj", "w2", "fc2", "fc_out",
    "dense_4h_to_h", "attn_out", "mlp_out",
}  # fmt: skip
_VOCAB = {
    "embed_tokens", "wte", "tok_embeddings", "word_embeddings", "shared", "embed",
    "embeddings", "token_embedding", "tok_embed", "token_embed", "tokens",
}  # fmt: skip
_HEAD = {"lm_head", "output", "head", "unembed", "embed_out"}
_POSITION = {"wpe", "positions", "position_embeddings", "pos_embed", "pos_embedding",
             "position_embedding", "embed_positions"}  # fmt: skip
_NORM = re.compile(r"(norm|^ln(_|\d|$)|^ln_f$|layernorm|rms)")
_BIAS_WORDS = {"bias", "b"}
_WEIGHT_WORDS = {"kernel", "weight", "w", "embedding", "scale"}
_KINDS = {
    "colwise": "column", "column": "column", "col": "column",
    "rowwise": "row", "row": "row",
    "vocab": "vocab", "embedding": "vocab",
    "replicate": "replicated", "replicated": "replicated", "none": "replicated",
}  # fmt: skip


@dataclass(frozen=True)
class TPChoice:
    """How AutoTP laid out one leaf.

    Attributes:
      path: the leaf's dotted path.
      spec: its ``PartitionSpec`` over the model axis (``P()``: replicated).
      rule: which rule chose it, e.g. ``"column (q_proj)"``, ``"row bias: replicated"``,
        ``"tp_plan '*.fc_in.*'"``, ``"your annotation"``; ``"no rule: replicated"`` when none
        matched.
    """

    path: str
    spec: P
    rule: str

    @property
    def matched(self) -> bool:
        """Whether a rule (or the user) decided this leaf's layout."""
        return not self.rule.startswith("no rule")


def _role_and_names(path: str) -> tuple[str, list[str]]:
    """The leaf's role (``"bias"`` or ``"weight"``) and its path's name components, deepest last:
    ``blocks.attn_qkv_bias`` -> ("bias", ["blocks", "attn_qkv"])."""
    parts = [p for p in path.split(".") if p and not p.isdigit()]
    if not parts:
        return "weight", []
    last = parts[-1].lower()
    if last in _BIAS_WORDS:
        return "bias", parts[:-1]
    if last in _WEIGHT_WORDS and len(parts) > 1:
        return "weight", parts[:-1]
    for suffix, role in (("_bias", "bias"), ("_weight", "weight"), ("_kernel", "weight"),
                         ("_scale", "weight")):  # fmt: skip
        if last.endswith(suffix) and len(last) > len(suffix):
            return role, [*parts[:-1], parts[-1][: -len(suffix)]]
    return "weight", parts


def _builtin(path: str, shape: tuple[int, ...], vocab: int | None) -> tuple[str, int | None, str]:
    """``(rule, dim to split or None, name matched)`` of the built-in rules for one leaf."""
    role, names = _role_and_names(path)
    if not names:
        return "no rule: replicated", None, ""
    name = names[-1]
    low = name.lower()
    if _NORM.search(low):
        return f"norm ({name}): replicated", None, name
    if low in _POSITION:
        return f"position table ({name}): replicated", None, name
    if low in _FUSED_QKV:
        if len(shape) >= 2 and shape[-2] == 3 and (role == "bias" or len(shape) >= 3):
            return f"fused qkv per head group ({name})", len(shape) - 1, name
        if role == "bias":
            return f"fused qkv bias ({name}), flat: replicated (small)", None, name
        return (
            f"fused qkv ({name}) flat {shape}: replicated (a (d, 3n) leaf cannot rest split per "
            "head; store it as (d, 3, n) or give it a tp_plan entry)",
            None,
            name,
        )
    if low in _COLUMN:
        return (f"column{' bias' if role == 'bias' else ''} ({name})", len(shape) - 1, name)
    if low in _ROW:
        if role == "bias" or len(shape) < 2:
            return f"row bias ({name}): replicated", None, name
        return f"row ({name})", len(shape) - 2, name
    if low in _VOCAB and role == "weight" and len(shape) >= 2:
        return f"vocab ({name})", len(shape) - 2, name
    if low in _HEAD and role == "weight" and len(shape) >= 2:
        dim = len(shape) - 1
        if vocab is not None and shape[-1] != vocab and shape[-2] == vocab:
            dim = len(shape) - 2  # stored (vocab, d), as a converted torch head is
        return f"vocab head ({name})", dim, name
    if low in _HEAD and role == "bias":
        return f"vocab head bias ({name})", len(shape) - 1, name
    return "no rule: replicated", None, name


def _heads_layout(paths: Sequence[str], shapes: Sequence[tuple[int, ...]]) -> dict:
    """Flax's multi-head attention (``MultiHeadDotProductAttention``, NNX's
    ``MultiHeadAttention``): ``query``/``key``/``value`` kernels ``(..., d, H, Dh)`` and an
    ``out`` kernel ``(..., H, Dh, d)`` beside them. There the heads dimension is split, not the
    last (which would cut every head in two): ``{path: (rule, dim)}`` for those leaves."""
    where = {path: shape for path, shape in zip(paths, shapes, strict=True)}
    found: dict[str, tuple[str, int | None]] = {}
    for path, shape in where.items():
        parts = path.split(".")
        if len(parts) < 3 or parts[-1] != "kernel" or parts[-2] not in ("query", "key", "value"):
            continue
        parent = ".".join(parts[:-2])
        out = where.get(f"{parent}.out.kernel")
        if len(shape) < 3 or out is None or len(out) < 3 or out[-3:-1] != shape[-2:]:
            continue
        name = parts[-2]
        found[path] = (f"column per head ({name})", len(shape) - 2)
        bias = where.get(f"{parent}.{name}.bias")
        if bias is not None and bias[-2:] == shape[-2:]:
            found[f"{parent}.{name}.bias"] = (f"column bias per head ({name})", len(bias) - 2)
        found[f"{parent}.out.kernel"] = ("row per head (out)", len(out) - 3)
        if f"{parent}.out.bias" in where:
            found[f"{parent}.out.bias"] = ("row bias (out): replicated", None)
    return found


def _spec(ndim: int, dim: int | None, axis: str) -> P:
    if dim is None:
        return P()
    return P(*([None] * dim), axis)


def _from_plan(kind: Any, shape: tuple[int, ...], axis: str, where: str) -> tuple[P, int | None]:
    """A ``tp_plan`` value as a spec (and the dimension it splits over ``axis``)."""
    if isinstance(kind, str):
        k = _KINDS.get(kind.lower())
        if k is None:
            raise ValueError(
                f"tensor_parallel.tp_plan[{where!r}]: {kind!r} is not a layout; use one of "
                f"{sorted(set(_KINDS))}, or a spec list such as [null, {axis!r}]."
            )
        dim = {"column": len(shape) - 1, "row": len(shape) - 2, "vocab": len(shape) - 2,
               "replicated": None}[k]  # fmt: skip
        if dim is not None and dim < 0:
            raise ValueError(
                f"tensor_parallel.tp_plan[{where!r}]: {kind!r} needs a leaf of 2 dimensions or "
                f"more, but it matched one of shape {shape}; use 'replicate' for it."
            )
        return _spec(len(shape), dim, axis), dim
    if isinstance(kind, Sequence) and not isinstance(kind, str):
        entries = [None if e in (None, "null", "None") else e for e in kind]
        if len(entries) > len(shape) or any(e not in (None, axis) for e in entries):
            raise ValueError(
                f"tensor_parallel.tp_plan[{where!r}]: the spec {list(kind)} must have at most "
                f"{len(shape)} entries (the leaf is {shape}), each null or {axis!r}."
            )
        dims = [i for i, e in enumerate(entries) if e == axis]
        return P(*entries), (dims[0] if dims else None)
    raise ValueError(
        f"tensor_parallel.tp_plan[{where!r}]: {kind!r} is neither a layout name (colwise, "
        f"rowwise, vocab, replicate) nor a spec list such as [null, {axis!r}]."
    )


def _user_spec(spec: Any) -> bool:
    return spec is not None and any(e is not None for e in tuple(spec))


def autotp_specs(
    params: PyTree,
    tp_size: int,
    *,
    tp_plan: Mapping[str, Any] | None = None,
    param_specs: PyTree | None = None,
    num_heads: int | None = None,
    axis: str = MODEL_AXIS,
    program: Mapping[int, ProgramSplit] | None = None,
    by_name: bool = True,
) -> tuple[PyTree, tuple[TPChoice, ...]]:
    """Megatron-style ``model``-axis specs for a params tree, from names and shapes, and from
    the model's program for the leaves no name matches.

    Args:
      params: the parameters (arrays or ``jax.ShapeDtypeStruct``; only shapes and paths are
        read).
      tp_size: the model axis's size (DeepSpeed's ``autotp_size``).
      tp_plan: glob patterns of dotted paths to ``colwise`` / ``rowwise`` / ``vocab`` /
        ``replicate`` or a spec list; the first match wins over the built-in rules.
      param_specs: the user's own specs per leaf (``None`` or ``P()`` where none); a leaf
        with one keeps it.
      num_heads: the attention heads, when known: ``tp_size`` must divide them.
      axis: the model axis's name.
      program: the splits read from the traced loss
        (:func:`jzero.rewrite.megatron.program_splits`), by leaf index: they lay out the
        leaves no name rule matched. A pair whose split dimension ``tp_size`` does not divide
        stays replicated, listed as unmatched.
      by_name: ``False`` skips the name rules (the program alone decides, then the
        ``tp_plan``); for comparing the two.

    Returns:
      ``(specs, choices)``: a tree of ``PartitionSpec`` with the params' structure, and one
      :class:`TPChoice` per leaf in ``jax.tree.leaves`` order.

    Raises:
      ValueError: when ``tp_size`` does not divide a split dimension or the heads, or a
        ``tp_plan`` entry is not a layout.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> params = {"q_proj": {"kernel": jax.ShapeDtypeStruct((64, 64), jnp.float32)},
      ...           "o_proj": {"kernel": jax.ShapeDtypeStruct((64, 64), jnp.float32)}}
      >>> specs, choices = autotp_specs(params, 2)
      >>> specs["q_proj"]["kernel"], specs["o_proj"]["kernel"]
      (PartitionSpec(None, 'model'), PartitionSpec('model',))
    """
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
        raise ValueError(f"autotp_size: {tp_size!r} must be a positive integer.")
    if num_heads is not None and num_heads % tp_size:
        raise ValueError(
            f"tensor_parallel.autotp_size: {tp_size} does not divide the {num_heads} attention "
            f"heads, so the heads cannot be split evenly over the model axis; choose an "
            f"autotp_size among the divisors of {num_heads} "
            f"({', '.join(map(str, divisors(num_heads)))})."
        )
    flat, treedef = jax.tree_util.tree_flatten_with_path(params)
    users = treedef.flatten_up_to(param_specs) if param_specs is not None else [None] * len(flat)
    paths = [dotted(p) or "<root>" for p, _ in flat]
    shapes = [tuple(x.shape) for _, x in flat]
    vocab = next(
        (
            s[-2]
            for path, s in zip(paths, shapes, strict=True)
            if len(s) >= 2 and _builtin(path, s, None)[0].startswith("vocab (")
        ),
        None,
    )
    heads = _heads_layout(paths, shapes) if by_name else {}
    uneven = _uneven_groups(program or {}, paths, shapes, tp_size)
    choices = []
    for path, shape, user in zip(paths, shapes, users, strict=True):
        if _user_spec(user):
            choices.append(TPChoice(path, P(*tuple(user)), "your annotation"))
            continue
        pattern = next((pat for pat in (tp_plan or {}) if fnmatch.fnmatchcase(path, pat)), None)
        if pattern is not None:
            spec, dim = _from_plan(tp_plan[pattern], shape, axis, pattern)
            rule = f"tp_plan {pattern!r}"
        else:
            rule, dim = "no rule: replicated", None
            if by_name:
                rule, dim = heads[path] if path in heads else _builtin(path, shape, vocab)[:2]
            if rule.startswith("no rule") and program is not None:
                rule, dim = _from_program(program.get(len(choices)), uneven)
            spec = _spec(len(shape), dim, axis)
        if dim is not None and tp_size > 1 and shape[dim] % tp_size:
            raise ValueError(
                f"tensor_parallel.autotp_size: {tp_size} does not divide dimension {dim} "
                f"({shape[dim]}) of {path} {shape}, which the rule {rule} splits over "
                f"{axis!r}. Choose an autotp_size that divides {shape[dim]}, or give "
                f"{path} another layout in tensor_parallel.tp_plan (e.g. {{'{path}': "
                "'replicate'})."
            )
        choices.append(TPChoice(path, spec if tp_size > 1 else P(), rule))
    return treedef.unflatten([c.spec for c in choices]), tuple(choices)


def _uneven_groups(
    program: Mapping[int, ProgramSplit],
    paths: Sequence[str],
    shapes: Sequence[tuple[int, ...]],
    tp_size: int,
) -> dict[int, str]:
    """The program's pairs ``tp_size`` cannot split: ``{group: why}`` (the first leaf whose
    split dimension it does not divide)."""
    out: dict[int, str] = {}
    for i, split in sorted(program.items()):
        size = shapes[i][split.dim]
        if tp_size > 1 and size % tp_size and split.group not in out:
            out[split.group] = f"dimension {split.dim} ({size}) of {paths[i]}"
    return out


def _from_program(split: ProgramSplit | None, uneven: Mapping[int, str]) -> tuple:
    """A program split as ``(rule, dim)``: replicated where the program pairs the leaf with
    nothing (a norm, a row bias, a position table), and, with the reason, where its pair
    cannot be split evenly."""
    if split is None:
        return "replicated (from the program: in no matmul pair)", None
    if split.group in uneven:
        why = uneven[split.group]
        return (
            f"no rule: replicated ({split.kind} from the program, but autotp_size does not "
            f"divide its pair's {why}; give it a tensor_parallel.tp_plan entry)",
            None,
        )
    return f"{split.kind} (from the program)", split.dim


def unmatched(choices: Sequence[TPChoice]) -> list[str]:
    """The paths no rule matched (replicated over the model axis), for the plan report."""
    return [c.path for c in choices if not c.matched]
