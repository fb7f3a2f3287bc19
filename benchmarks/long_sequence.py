"""Long sequences: the built-in GPT's temporaries against the sequence length, with the plain
forms and with blockwise attention, the tiled loss and the tiled MLP (:mod:`jzero.ops`).

Run: ``python benchmarks/long_sequence.py [--smoke]``. For each sequence length the built-in
GPT (one layer, d_model 256, 8 heads, d_ff 1024, a 32,000-token vocabulary, float32, one
sequence) has its loss and gradients (``jax.value_and_grad`` of ``loss_fn``) compiled on one
device, never run, four ways:

* **plain**: ``attention_block`` = the length, ``loss_chunk`` = ``mlp_chunk`` = 0, so the
  ``[H, T, T]`` scores, the ``[T, V]`` logits and the ``[T, d_ff]`` MLP layer are whole;
* **+ blockwise attention**: ``attention_block`` 512;
* **+ tiled loss**: and ``loss_chunk`` 1024;
* **+ tiled MLP**: and ``mlp_chunk`` 1024.

The figure is ``compiled.memory_analysis().temp_size_in_bytes``: the compiler's temporaries
(activations, scores, logits, gradients in flight). The plain form's grow with ``T^2``; the
tiled forms' with ``T``.

``--budget SIZE`` prints a second table instead: the longest sequence the built-in GPT (4
layers, d_model 256, 2 heads, d_ff 1024, a 32,000-token vocabulary, float32, Adam, ZeRO-3)
trains within ``SIZE`` per device, each row adding one technique to the one before:
plain attention, loss and MLP on 1 device; + blockwise attention; + tiled loss and MLP; +
activation checkpointing (``policy: full``); + activation offload (``cpu_checkpointing``);
and the full set with ring attention over 8 devices (``context_parallel_size: 8``). A
sequence trains within the budget when the compiled step's peak (``args + temp + outputs
not aliased``, :mod:`jzero.memory`'s measured peak) does: lengths are searched in steps of
``2 x context x attention_block`` tokens (doubling, then halving the gap), each probe an
abstract engine whose step is compiled, never run. On CPU the offload row cannot differ
from the row before it: host and device memory are one there, and the compiler reports no
host bytes (``docs/benchmarks.md``); the GPU section of ``benchmarks/gpu_check.sh`` measures
it on a device. A third table compares the ring with Ulysses at the same length on 8
devices: the bytes each moves a step (collective-permutes over ``context``, all-to-alls over
``seq``, from the compiled step) and tokens per second.

``--positions rotary`` builds every table's GPT with rotary positions (``model.positions``: no
``[T, d_model]`` position table, which ZeRO-3 gathers whole on every device and which the ring
therefore does not divide); ``learned`` (the default) is the table.

``--gpu`` (``benchmarks/gpu_check.sh``'s ``long_context`` section) measures on the devices
JAX has: attention alone in bf16 (``[1, T, 8, 128]``, forward and backward) through cuDNN's
fused attention (:func:`jzero.blockwise_attention` picks it on a GPU) and through the
blockwise XLA path, ms per call and the device's peak bytes; then the GPT with every
technique (ring over all devices where there are several) trained at ``--gpu-seq`` tokens
(131,072 by default), ms per step, tokens per second and the device's peak
(``memory_stats()``). On CPU (``--smoke``) both attention rows are the XLA path.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import jzero
from jzero import hlo, memory
from jzero.demo import gpt

MIB = 1 << 20


def temp_bytes(cfg: gpt.GPTConfig) -> int:
    """The compiled loss-and-gradients program's temporaries for one sequence of ``cfg``."""
    params = jax.eval_shape(lambda: gpt.init_params(jax.random.key(0), cfg))
    tokens = jax.ShapeDtypeStruct((1, cfg.seq_len + 1), np.int32)
    step = jax.jit(jax.value_and_grad(lambda p, t: gpt.loss_fn(p, {"tokens": t}, cfg)))
    return step.lower(params, tokens).compile().memory_analysis().temp_size_in_bytes


def variants(cfg: gpt.GPTConfig, block: int, chunk: int) -> list[tuple[str, gpt.GPTConfig]]:
    """The four forms of one length, each adding one tiling to the one before."""
    plain = dataclasses.replace(cfg, attention_block=cfg.seq_len, loss_chunk=0, mlp_chunk=0)
    attention = dataclasses.replace(plain, attention_block=block)
    loss = dataclasses.replace(attention, loss_chunk=chunk)
    return [
        ("plain", plain),
        ("+ blockwise attention", attention),
        ("+ tiled loss", loss),
        ("+ tiled MLP", dataclasses.replace(loss, mlp_chunk=chunk)),
    ]


@dataclasses.dataclass(frozen=True)
class Row:
    """One row of the budget table: a name, the devices and what the run turns on."""

    name: str
    devices: int = 1
    blockwise: bool = False
    tiled: bool = False
    policy: str | None = None
    offload: bool = False
    context: int = 1
    seq: int = 1


ROWS = (
    Row("plain, 1 device"),
    Row("+ blockwise attention", blockwise=True),
    Row("+ tiled loss and MLP", blockwise=True, tiled=True),
    Row("+ activation checkpointing", blockwise=True, tiled=True, policy="full"),
    Row("+ activation offload", blockwise=True, tiled=True, policy="full", offload=True),
    Row("+ ring over 8 devices", 8, blockwise=True, tiled=True, policy="full", context=8),
)


def budget_engine(
    base: gpt.GPTConfig, row: Row, t: int, block: int, chunk: int, *, live: bool = False
) -> tuple:
    """A ZeRO-3 engine of ``row`` at length ``t`` (abstract unless ``live``), one sequence per
    data-parallel rank, and its batch's shapes."""
    rows = row.devices // row.context // row.seq
    cfg = dataclasses.replace(
        base,
        seq_len=t,
        attention_block=block if row.blockwise else t,
        loss_chunk=chunk if row.tiled else 0,
        mlp_chunk=chunk if row.tiled else 0,
    )
    config: dict = {
        "train_batch_size": rows,
        "zero_optimization": {"stage": 3},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "gradient_clipping": 1.0,
    }
    if row.policy:
        config["activation_checkpointing"] = {
            "policy": row.policy,
            "cpu_checkpointing": row.offload,
        }
    options = jzero.InitOptions()
    if row.context > 1 or row.seq > 1:
        config["context_parallel_size"] = row.context
        config["sequence_parallel_size"] = row.seq
    else:
        devices = np.array(jax.devices()[: row.devices])
        options = jzero.InitOptions(mesh=jax.sharding.Mesh(devices, ("data",)))
    engine = jzero.initialize(
        model=lambda: gpt.GPT(cfg, rngs=nnx.Rngs(0)),
        loss_fn=gpt.nnx_loss_fn,
        config=config,
        abstract=not live,
        options=options,
    )
    return engine, {"tokens": jax.ShapeDtypeStruct((rows, t + 1), jnp.int32)}


def peak_bytes(engine, batch) -> int:
    """The compiled step's peak per device, as :mod:`jzero.memory` measures it."""
    return memory.memory_report(engine, batch).rows[0].peak


def longest(fits, granule: int, start: int, most: int) -> int:
    """The largest multiple of ``granule`` (up to ``most``) for which ``fits`` holds, by
    doubling from ``start`` and then halving the gap; 0 when even ``granule`` does not fit."""
    good, t = 0, max(granule, start // granule * granule)
    while t <= most and fits(t):
        good, t = t, t * 2
    bad = min(t, most + granule)
    if good == 0:
        if granule < t and fits(granule):
            good = granule
        else:
            return 0
    while bad - good > granule:
        mid = (good + bad) // 2 // granule * granule
        if mid <= good:
            break
        good, bad = (mid, bad) if fits(mid) else (good, mid)
    return good


def budget_table(
    base: gpt.GPTConfig, budget: int, block: int, chunk: int, most: int, first: int = 0
) -> dict:
    """Prints the longest sequence of each row within ``budget`` bytes (searched from
    ``first`` tokens, or the row's step, up to ``most``); returns them."""
    print(
        f"### Longest sequence within {budget / MIB:.0f} MiB per device (GPT {base.num_layers} "
        f"layers, d_model {base.d_model}, {base.num_heads} heads, vocab {base.vocab_size}, "
        f"{base.positions} positions, float32, AdamW, ZeRO-3; attention_block {block}, chunks "
        f"{chunk})"
    )
    print()
    print("| technique | devices | longest sequence | x plain | peak MiB at it | probes |")
    print("|---|---:|---:|---:|---:|---:|")
    found: dict = {}
    for row in ROWS:
        peaks: dict[int, int] = {}

        def fits(t: int, row: Row = row, peaks: dict = peaks) -> bool:
            peaks[t] = peak_bytes(*budget_engine(base, row, t, block, chunk))
            return peaks[t] <= budget

        granule = 2 * row.context * block
        start = max(granule, first, max(found.values(), default=granule))
        t = longest(fits, granule, start, most)
        found[row.name] = t
        plain = found[ROWS[0].name] or 1
        at = f"{peaks[t] / MIB:.1f}" if t else "-"
        print(
            f"| {row.name} | {row.devices if row.context == 1 else row.context} | {t} | "
            f"{t / plain:.1f} | {at} | {len(peaks)} |",
            flush=True,
        )
    return found


def axis_bytes(engine, batch, axis: str) -> int:
    """Bytes the compiled step moves over collectives of ``axis`` alone, per device."""
    compiled = engine.lower(batch).compile()
    stats = hlo.collectives_by_axes(compiled, engine.mesh).get((axis,), {})
    return sum(s.bytes for s in stats.values())


def ring_vs_ulysses(base: gpt.GPTConfig, t: int, block: int, chunk: int, steps: int) -> None:
    """Prints the ring's and Ulysses's bytes a step and tokens per second at length ``t`` on 8
    devices (Ulysses over the head count at most: ``seq`` = heads, the rest data)."""
    heads = base.num_heads
    rows = [
        (Row("ring attention", 8, True, True, context=8), "context"),
        (Row(f"Ulysses (seq {heads})", 8, True, True, seq=heads), "seq"),
    ]
    print(f"### Ring against Ulysses at {t} tokens on 8 devices ({steps} timed steps)")
    print()
    print("| layout | sequences/step | axis | axis MB/step | tokens/s |")
    print("|---|---:|---|---:|---:|")
    for row, axis in rows:
        engine, shapes = budget_engine(base, row, t, block, chunk, live=True)
        moved = axis_bytes(engine, shapes, axis)
        n = shapes["tokens"].shape[0]
        tokens = np.random.default_rng(0).integers(0, base.vocab_size, shapes["tokens"].shape)
        batch = {"tokens": jnp.asarray(tokens, jnp.int32)}
        jax.block_until_ready(engine.train_step(batch))  # compiles
        started = time.perf_counter()
        for _ in range(steps):
            jax.block_until_ready(engine.train_step(batch))
        rate = steps * n * t / (time.perf_counter() - started)
        print(f"| {row.name} | {n} | {axis} | {moved / 1e6:.2f} | {rate:.0f} |", flush=True)


def _timed(fn, *args, repeats: int) -> float:
    """Milliseconds per call of ``fn`` (compiled and run once before)."""
    jax.block_until_ready(fn(*args))
    started = time.perf_counter()
    for _ in range(repeats):
        jax.block_until_ready(fn(*args))
    return (time.perf_counter() - started) * 1e3 / repeats


def _peak() -> int | None:
    """The first device's peak bytes in use so far (``None`` where JAX does not say)."""
    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("peak_bytes_in_use")


def gpu_tables(base: gpt.GPTConfig, t: int, attention_t: int, repeats: int) -> None:
    """The ``--gpu`` tables: attention through cuDNN and blockwise, then the GPT at ``t``."""
    device = jax.devices()[0]
    print(f"### Attention in bf16, [1, {attention_t}, 8, 128], forward and backward, on "
          f"{device.device_kind}")  # fmt: skip
    print()
    print("| path | ms/call | peak MiB |")
    print("|---|---:|---:|")
    keys = jax.random.split(jax.random.key(0), 3)
    q, k, v = (jax.random.normal(x, (1, attention_t, 8, 128), jnp.bfloat16) for x in keys)
    where = jnp.arange(attention_t)[None]
    paths = {
        "cuDNN (picked on a GPU)" if device.platform == "gpu" else "XLA (no GPU)": {},
        "blockwise XLA (positions given)": {"positions": where},
    }
    for name, extra in paths.items():

        def loss(q, k, v, extra=extra):
            out = jzero.blockwise_attention(q, k, v, block_size=512, **extra)
            return out.astype(jnp.float32).sum()

        ms = _timed(jax.jit(jax.grad(loss, argnums=(0, 1, 2))), q, k, v, repeats=repeats)
        peak = _peak()
        print(f"| {name} | {ms:.2f} | {'-' if peak is None else f'{peak / MIB:.0f}'} |")
    print()
    n = jax.device_count()
    cfg = dataclasses.replace(base, seq_len=t, dtype="bfloat16")
    config = {
        "train_batch_size": 1,
        "zero_optimization": {"stage": 3},
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "activation_checkpointing": {"policy": "full", "cpu_checkpointing": True},
        "context_parallel_size": n,
    }
    engine = jzero.initialize(
        model=lambda: gpt.GPT(cfg, rngs=nnx.Rngs(0)), loss_fn=gpt.nnx_loss_fn, config=config
    )
    tokens = np.random.default_rng(0).integers(0, base.vocab_size, (1, t + 1))
    batch = {"tokens": jnp.asarray(tokens, jnp.int32)}
    ms = _timed(engine.train_step, batch, repeats=repeats)
    peak = _peak()
    print(f"### The GPT with every technique at {t} tokens on {n} x {device.device_kind}")
    print()
    print("| tokens | devices | ms/step | tokens/s | peak MiB (device 0) |")
    print("|---:|---:|---:|---:|---:|")
    print(f"| {t} | {n} | {ms:.0f} | {t / ms * 1e3:.0f} | "
          f"{'-' if peak is None else f'{peak / MIB:.0f}'} |")  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="length 64, a tiny model, blocks of 16")
    ap.add_argument("--seq-lens", help="comma-separated (default 1024,2048,4096,8192)")
    ap.add_argument("--budget", help="per-device memory (e.g. 2GiB): the longest-sequence tables")
    ap.add_argument("--most", type=int, default=1 << 20, help="the longest length probed")
    ap.add_argument("--first", type=int, default=0, help="the first length probed")
    ap.add_argument("--steps", type=int, default=3, help="timed steps of the ring/Ulysses table")
    ap.add_argument("--compare-seq", type=int, default=8192, help="the ring/Ulysses length")
    ap.add_argument(
        "--compare-only", action="store_true", help="with --budget: the ring/Ulysses table alone"
    )
    ap.add_argument(
        "--positions", choices=("learned", "rotary"), default="learned",
        help="the GPT's positions: a learned table (default) or rotary (no table)",
    )  # fmt: skip
    ap.add_argument("--gpu", action="store_true", help="the GPU tables (gpu_check.sh)")
    ap.add_argument("--gpu-seq", type=int, default=131072, help="the GPT's length under --gpu")
    # gpu_check.sh passes its shared flags to every section: --layers, --d-model and --heads
    # shape the --gpu GPT; --seq-len is its length; the others are not read here.
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--seq-len", type=int, help="the same as --gpu-seq")
    args, _ = ap.parse_known_args(argv)
    # The one-device rows are ZeRO-3 on a mesh of one device, which jzero warns splits nothing.
    warnings.filterwarnings("ignore", "ZeRO stage 3 splits the training state")
    if args.gpu:
        if args.smoke:
            base = gpt.GPTConfig(vocab_size=256, num_layers=1, num_heads=2, d_model=16, d_ff=32,
                                 attention_block=8, loss_chunk=8, mlp_chunk=8)  # fmt: skip
            gpu_tables(dataclasses.replace(base, positions=args.positions), 64, 64, repeats=1)
        else:
            base = gpt.GPTConfig(
                vocab_size=32000, num_layers=args.layers, num_heads=args.heads,
                d_model=args.d_model, d_ff=4 * args.d_model, loss_chunk=1024, mlp_chunk=1024,
            )  # fmt: skip
            base = dataclasses.replace(base, positions=args.positions)
            gpu_tables(base, args.seq_len or args.gpu_seq, 32768, repeats=args.steps)
        if not args.budget:
            return
        print()
    if args.budget:
        if args.smoke:
            base = gpt.GPTConfig(vocab_size=256, num_layers=1, num_heads=2, d_model=16, d_ff=32)
            block, chunk = 2, 8
        else:
            base = gpt.GPTConfig(vocab_size=32000, num_layers=4, num_heads=2, d_model=256,
                                 d_ff=1024)  # fmt: skip
            block, chunk = 512, 1024
        base = dataclasses.replace(base, positions=args.positions)
        t = args.compare_seq
        if not args.compare_only:
            budget = memory.parse_size(args.budget)
            found = budget_table(base, budget, block, chunk, args.most, args.first)
            print()
            t = min(t, found[ROWS[-1].name]) or 2 * 8 * block
        ring_vs_ulysses(base, t, block, chunk, args.steps)
        return
    if args.smoke:
        base = gpt.GPTConfig(vocab_size=512, num_layers=1, num_heads=2, d_model=32, d_ff=128)
        block, chunk, default = 16, 16, "64"
    else:
        base = gpt.GPTConfig(vocab_size=32000, num_layers=1, num_heads=8, d_model=256, d_ff=1024)
        block, chunk, default = 512, 1024, "1024,2048,4096,8192"
    base = dataclasses.replace(base, positions=args.positions)
    names = [name for name, _ in variants(base, block, chunk)]
    print(
        f"### Temporaries of the loss and gradients, MiB (GPT 1 layer, d_model {base.d_model}, "
        f"{base.num_heads} heads, d_ff {base.d_ff}, vocab {base.vocab_size}, float32, one "
        f"sequence; attention_block {block}, loss_chunk and mlp_chunk {chunk})"
    )
    print()
    print("| seq len | " + " | ".join(names) + " |")
    print("|---:|" + "---:|" * len(names))
    for t in (int(s) for s in (args.seq_lens or default).split(",")):
        cfg = dataclasses.replace(base, seq_len=t)
        cells = [temp_bytes(c) / MIB for _, c in variants(cfg, block, chunk)]
        print(f"| {t} | " + " | ".join(f"{c:.1f}" for c in cells) + " |", flush=True)


if __name__ == "__main__":
    main()
