"""GPU check of step time: ZeRO stages 0-3 against a hand-written plain JAX data-parallel step.

Issue: "Step time: ZeRO at the cost of plain data parallelism". Run on one accelerator through
``benchmarks/gpu_check.sh`` (it builds a fresh venv and runs this after the host-offload check),
or directly: ``python benchmarks/gpu_step_time.py`` (the built-in GPT at about 300 M parameters,
on every device of the machine) or ``--smoke`` (a tiny GPT and 2 steps, seconds on CPU; the
test suite runs it on 8 virtual CPU devices so that the script cannot rot).

The same script serves the memory-wall check (issue "The memory wall"): ``--name memory_wall
--stages 3,3-unrolled,3-unrolled-ac,3-unrolled-ac-cpu,3-ac`` runs stage 3 of the GPT as
written (a scan over stacked layers), of the same GPT written as a Python loop over layers
(``gpt.unrolled_loss_fn``), of that loop with ``activation_checkpointing: {policy: full}``
(each layer of the loop checkpointed), then with ``cpu_checkpointing: true`` (saved
activations in host memory), and of the scanned GPT with ``policy: full``, each with its
device peak.

What is measured, per variant (``plain-dp``, ``zero-0`` ... ``zero-3``, and the memory-wall
variants):

* The model: ``jzero.demo.gpt`` with 24 layers, d_model 1024, 16 heads, d_ff 4096, sequence
  512, vocabulary 256, ``dtype="bfloat16"`` (bf16 compute), micro-batch 8 per device; AdamW
  (``optax.adamw(1e-4)``) and gradient clipping 1.0 for every variant.
* ZeRO: ``jzero.initialize`` with ``bf16: {enabled: true}`` (16-bit parameters and gradients,
  float32 master weights and moments), ``stage3_param_persistence_threshold: 0`` and the
  stage, on a mesh of all devices.
* The floor: ``benchmarks/plain_dp.py``'s ``plain_dp_step`` (replicated parameters and
  optimizer state, batch sharded over ``data``, one ``jit``). Its parameters stay float32 and
  the GPT casts them to bf16 at use, so it computes in bf16 and updates float32 weights with
  float32 moments exactly as jzero's stages do: the same arithmetic and the same optimizer
  precision, i.e. what a JAX user writes for bf16 mixed precision. (Casting the parameters
  themselves to bf16 would run AdamW in bf16: a different, cheaper training.) Remaining
  differences, all in jzero's cost: jzero keeps a bf16 copy of the parameters next to the
  float32 masters, casts the updated masters into it every step, checks the gradients for
  inf/NaN, and reduces 16-bit gradients where the floor reduces float32 ones.
* Compile time: wall time of ``lower(...).compile()`` of the step (for jzero also the one-off
  trace that fits the stage-3 layout); the steps then reuse that executable. The floor is
  lowered and compiled the same way (``PlainDP.lower()``).
* Step time: the median over ``--steps`` steps after ``--warmup`` steps, each step waited for
  in full (``block_until_ready`` on the metrics and the whole new state). tokens/s is the
  global batch's tokens over that median.
* MFU: model FLOPs per second over the devices' peak dense bf16 FLOP/s. Model FLOPs per token
  of a decoder's training step are the usual estimate of the PaLM paper's appendix B:
  ``6 N + 12 L d T`` (N parameters, L layers, d = heads x head dim = d_model, T sequence
  length; the first term is the matmuls forward and backward, the second the attention
  scores and values, without causal savings). N counts every parameter: the tied output head
  makes the token table a real matmul; the position table (< 0.2 % of N) is counted although
  it costs none. Rematerialisation is not counted (this is model FLOPs, not hardware FLOPs).
  Peaks come from :data:`PEAK_BF16_FLOPS`, matched on ``device_kind``; an unknown device (a
  CPU) shows ``n/a``; ``--peak-flops`` (per device) overrides.
* From the compiled step: collective bytes per step (``jzero.hlo.collectives``; the table
  sums ``wire_bytes``, an all-reduce counted twice) and the copies/transposes adjacent to a
  collective (``jzero.hlo.layout_copies``: count and MiB, once per program; ``n/a`` where the
  installed jzero lacks it). On CPU the compiler widens 16-bit collectives to float32, so the
  smoke run's bytes are not the GPU's; on one device there are no collectives at all.
* Memory: ``memory_stats()["peak_bytes_in_use"]`` of device 0 (``n/a`` on CPU), plus the
  compiled step's ``memory_analysis()`` in the JSON.

Decisions:

* Each variant runs in its own Python process, as in ``benchmarks/gpu_check.py``: a device's
  peak only grows within a process, so this gives each variant its own peak; a variant that
  crashes (out of memory, a compiler error) does not take the others down; and the parent
  can stop a variant at the time budget and still print the table. The parent never imports
  JAX (it would hold device memory). Each process pays JAX's start-up (seconds).
* ``--time-budget`` (seconds, default 160) bounds the whole run: a variant is not started once
  it is spent, and a running one is stopped when it runs out; both are printed as notes, and
  the table shows what was measured. ``--stages`` picks variants (``plain,0,1,2,3``).
* Exit status 1 when a variant failed (crashed, or exceeded ``--variant-timeout``), or when
  nothing was measured; variants cut by the time budget alone do not fail the run.
* ``--smoke`` lowers the CPU code generator's optimisation level in the child processes, as
  ``gpu_check.py`` does: it checks that the script runs, and compile time dominates there.
* Results go to ``$OUT/gpu_step_time.json`` when ``OUT`` is set, rewritten after each variant.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# benchmarks/ is sys.path[0] when run as a script: the GPT sizes and their flags are
# gpu_check.py's, so every GPU check trains the same model.
from gpu_check import SMOKE_XLA_FLAGS, add_size_args, child_argv, fill_sizes  # noqa: E402

MIB = 1 << 20
GIB = 1 << 30
STEP_TIME = ("plain-dp", "zero-0", "zero-1", "zero-2", "zero-3")
# The memory wall: stage 3 of the GPT written as a Python loop over layers, without and with
# activation checkpointing (policy full), then with its activations in host memory; and of the
# scanned GPT with activation checkpointing.
MEMORY_WALL = ("zero-3-unrolled", "zero-3-unrolled-ac", "zero-3-unrolled-ac-cpu", "zero-3-ac")
VARIANTS = STEP_TIME + MEMORY_WALL
VOCAB = 256
LEARNING_RATE = 1e-4
CLIP = 1.0
# Peak dense bf16 FLOP/s per device (vendor data sheets, without sparsity), matched in order as
# substrings of ``device.device_kind``; the more specific names come first.
PEAK_BF16_FLOPS = (
    ("H100 PCIe", 756e12),
    ("H200", 989e12),
    ("H100", 989e12),  # SXM ("NVIDIA H100 80GB HBM3")
    ("A100", 312e12),
)


def peak_flops(device_kind: str) -> float | None:
    """Peak dense bf16 FLOP/s of one device of this kind, or ``None`` when unknown."""
    for name, flops in PEAK_BF16_FLOPS:
        if name.lower() in device_kind.lower():
            return flops
    return None


def flops_per_token(params: int, layers: int, d_model: int, seq_len: int) -> int:
    """Model FLOPs of one training token of a decoder: 6 N + 12 L d T (PaLM, appendix B)."""
    return 6 * params + 12 * layers * d_model * seq_len


def _variants(text: str) -> list[str]:
    names = {"plain": "plain-dp", "plain-dp": "plain-dp", "dp": "plain-dp"}
    names.update({str(s): f"zero-{s}" for s in range(4)})
    names.update({f"zero-{s}": f"zero-{s}" for s in range(4)})
    names.update({v: v for v in MEMORY_WALL})
    names.update({v.removeprefix("zero-"): v for v in MEMORY_WALL})
    picked = set()
    for token in text.split(","):
        token = token.strip().lower()
        if token not in names:
            raise argparse.ArgumentTypeError(
                f"unknown variant {token!r}: use a comma-separated list of plain, 0, 1, 2, 3, "
                + ", ".join(v.removeprefix("zero-") for v in MEMORY_WALL)
            )
        picked.add(names[token])
    return [v for v in VARIANTS if v in picked]


def _memory_wall_order(variants: list[str]) -> list[str]:
    """The memory-wall section compares against plain stage 3: run it first."""
    return sorted(variants, key=lambda v: (v != "zero-3", VARIANTS.index(v)))


def _parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_size_args(ap)
    ap.add_argument("--steps", type=int, help="timed steps (default 20, smoke 2)")
    ap.add_argument("--warmup", type=int, help="untimed steps first (default 3, smoke 1)")
    ap.add_argument(
        "--stages",
        type=_variants,
        default=list(STEP_TIME),
        help="variants to run, comma-separated among plain,0,1,2,3 (default) and "
        "3-unrolled, 3-unrolled-ac, 3-unrolled-ac-cpu, 3-ac (the memory-wall section)",
    )
    ap.add_argument(
        "--name",
        default="step_time",
        help="the check's name: its title and $OUT/gpu_<name>.json (default step_time)",
    )
    ap.add_argument(
        "--time-budget",
        type=float,
        default=160.0,
        help="seconds for all variants; the rest are skipped with a note (default 160)",
    )
    ap.add_argument(
        "--variant-timeout", type=float, default=150.0, help="seconds per variant process"
    )
    ap.add_argument(
        "--peak-flops", type=float, help="peak bf16 FLOP/s of one device (overrides the table)"
    )
    ap.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)  # child process
    ap.add_argument("--result", help=argparse.SUPPRESS)  # child process: where its JSON goes
    args = ap.parse_args(argv)
    fill_sizes(args)
    if args.steps is None:
        args.steps = 2 if args.smoke else 20
    if args.warmup is None:
        args.warmup = 1 if args.smoke else 3
    if args.steps < 1 or args.warmup < 0:
        ap.error("--steps must be at least 1 and --warmup at least 0")
    return args


# -- one variant (a child process) --------------------------------------------------------------
def _plain_dp(cfg: Any, loss: Any, tx: Any, mesh: Any, batch: Any, seed: int) -> tuple:
    """The floor's (compile, step, state) from ``benchmarks/plain_dp.py``."""
    import jax
    from plain_dp import plain_dp_step  # benchmarks/ is sys.path[0] when run as a script

    from jzero.demo import gpt

    # float32, as jzero makes them from a function of a key (one jit, not op by op); the GPT
    # computes in bf16
    params = jax.jit(lambda key: gpt.init_params(key, cfg))(jax.random.key(seed))
    run = plain_dp_step(params, tx, loss, mesh, batch, clip=CLIP)
    del params
    # compiled explicitly (as jzero's engine.lower); a step waits for the new state too
    return lambda: run.lower().compile(), lambda: (run(), run.state)


def _zero(cfg: Any, loss: Any, tx: Any, variant: str, batch: Any) -> tuple:
    """A ZeRO variant's (compile, step) through jzero: ``zero-S`` or a memory-wall variant."""
    import jax

    import jzero
    from jzero.demo import gpt

    config: dict[str, Any] = {
        "train_batch_size": batch["tokens"].shape[0],
        "gradient_clipping": CLIP,
        "bf16": {"enabled": True},
        "zero_optimization": {
            "stage": int(variant.split("-")[1]),
            "stage3_param_persistence_threshold": 0,
        },
    }
    if "-ac" in variant:
        config["activation_checkpointing"] = {
            "policy": "full",
            "cpu_checkpointing": variant.endswith("-cpu"),
        }
    init = lambda key: gpt.init_params(key, cfg)  # noqa: E731
    if "-unrolled" in variant:
        init = lambda key: gpt.unstack_blocks(gpt.init_params(key, cfg))  # noqa: E731
        loss = lambda p, b: gpt.unrolled_loss_fn(p, b, cfg)  # noqa: E731
    engine = jzero.initialize(init, loss_fn=loss, optimizer=tx, config=config)
    placed = jax.device_put(batch, engine.plan.batch)  # on device once, as the floor's batch

    def step() -> tuple[Any, Any]:
        metrics = engine.train_step(placed)
        return metrics, engine.state

    return lambda: engine.lower(placed).compile(), step


def run_variant(args: argparse.Namespace) -> dict[str, Any]:
    """Compiles and times one variant; returns its measurements (runs in a child process)."""
    import jax
    import numpy as np
    import optax

    import jzero.hlo.facts
    from jzero.demo import gpt
    from jzero.distributed import make_mesh

    device = jax.devices()[0]
    n = jax.device_count()
    cfg = gpt.GPTConfig(
        vocab_size=VOCAB,
        seq_len=args.seq_len,
        num_layers=args.layers,
        num_heads=args.heads,
        d_model=args.d_model,
        d_ff=4 * args.d_model,
        dtype="bfloat16",
    )
    loss = lambda p, b: gpt.loss_fn(p, b, cfg)  # noqa: E731
    tx = optax.adamw(LEARNING_RATE)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, VOCAB, (args.micro_batch * n, args.seq_len + 1), dtype=np.int32)
    batch = {"tokens": tokens}
    abstract = jax.eval_shape(lambda key: gpt.init_params(key, cfg), jax.random.key(0))
    params = sum(math.prod(x.shape) for x in jax.tree.leaves(abstract))
    if args.variant == "plain-dp":
        mesh = make_mesh()  # every device on the data axis, as jzero's default config
        compile_fn, step = _plain_dp(cfg, loss, tx, mesh, batch, seed=0)
    else:
        compile_fn, step = _zero(cfg, loss, tx, args.variant, batch)

    start = time.perf_counter()
    compiled = compile_fn()
    compile_seconds = time.perf_counter() - start
    mem = compiled.memory_analysis()
    analysis = {
        k: int(getattr(mem, f"{k}_size_in_bytes", 0) or 0)
        for k in ("argument", "output", "alias", "temp", "generated_code")
    }
    coll = jzero.hlo.collectives(compiled)
    layout = getattr(jzero.hlo, "layout_copies", None)
    copies = None
    if layout is not None:
        found = layout(compiled)
        copies = {"count": len(found), "bytes": sum(c.bytes for c in found)}
    del compiled

    losses, times = [], []
    for i in range(args.warmup + args.steps):
        start = time.perf_counter()
        out = step()
        jax.block_until_ready(out)
        if i >= args.warmup:
            times.append(time.perf_counter() - start)
        value = out[0]["loss"] if isinstance(out[0], dict) else out[0]
        losses.append(float(value))
    stats = device.memory_stats() or {}
    return {
        "variant": args.variant,
        "params": params,
        "devices": n,
        "device_kind": device.device_kind,
        "platform": device.platform,
        "jax": jax.__version__,
        "compile_seconds": compile_seconds,
        "step_seconds": times,
        "step_seconds_median": statistics.median(times),
        "tokens_per_step": args.micro_batch * n * args.seq_len,
        "collectives": {
            k: {"count": s.count, "bytes": s.bytes, "wire_bytes": s.wire_bytes}
            for k, s in coll.items()
        },
        "layout_copies": copies,
        "memory_analysis": analysis,
        "peak_bytes_in_use": stats.get("peak_bytes_in_use"),
        "bytes_limit": stats.get("bytes_limit"),
        "losses": losses,
    }


# -- the parent ---------------------------------------------------------------------------------
def _run_child(
    args: argparse.Namespace, variant: str, env: dict[str, str], left: float, tmp: str
) -> dict[str, Any]:
    """Runs one variant's process; returns its result, or a status saying why there is none."""
    result = Path(tmp) / f"{variant}.json"
    limit = min(args.variant_timeout, left)
    start = time.monotonic()
    try:
        proc = subprocess.run(child_argv(__file__, args, variant, result), timeout=limit, env=env)
    except subprocess.TimeoutExpired:
        by_budget = left < args.variant_timeout
        return {
            "variant": variant,
            "status": "over budget" if by_budget else "timed out",
            "note": f"stopped after {limit:.0f} s "
            + ("(--time-budget ran out)" if by_budget else "(--variant-timeout)"),
        }
    if proc.returncode != 0 or not result.exists():
        return {
            "variant": variant,
            "status": "failed",
            "note": f"exit status {proc.returncode} after {time.monotonic() - start:.0f} s",
        }
    return {"status": "ok", **json.loads(result.read_text())}


def _fmt(value: float | None, spec: str, scale: float = 1.0) -> str:
    if value is None or not math.isfinite(value):
        return "n/a"
    return format(value * scale, spec)


def _derive(results: list[dict[str, Any]], peak: float | None) -> None:
    """Adds tokens/s, MFU (``None`` when the peak is unknown) and the ratio to plain DP."""
    ok = [r for r in results if r["status"] == "ok"]
    plain = next((r for r in ok if r["variant"] == "plain-dp"), None)
    for r in ok:
        t = r["step_seconds_median"]
        r["tokens_per_second"] = r["tokens_per_step"] / t
        r["model_flops_per_second"] = r["tokens_per_second"] * r["flops_per_token"]
        r["mfu"] = None if peak is None else r["model_flops_per_second"] / (peak * r["devices"])
        r["vs_plain_dp"] = t / plain["step_seconds_median"] if plain else None


def _row(r: dict[str, Any]) -> tuple[str, ...]:
    if r["status"] != "ok":
        return (r["variant"], r["status"], *("-" for _ in range(9)))
    wire = sum(c["wire_bytes"] for c in r["collectives"].values())
    copies = r["layout_copies"]
    peak_bytes = r["peak_bytes_in_use"]
    return (
        r["variant"],
        _fmt(r["step_seconds_median"], ".1f", 1e3),
        _fmt(r["vs_plain_dp"], ".2f"),
        _fmt(r["tokens_per_second"], ",.0f"),
        _fmt(r["mfu"], ".1%"),
        _fmt(r["compile_seconds"], ".1f"),
        _fmt(wire, ".1f", 1 / MIB),
        "n/a" if copies is None else str(copies["count"]),
        "n/a" if copies is None else _fmt(copies["bytes"], ".1f", 1 / MIB),
        _fmt(r["memory_analysis"]["temp"], ".1f", 1 / MIB),
        "n/a" if peak_bytes is None else _fmt(peak_bytes, ".2f", 1 / GIB),
    )


def table(results: list[dict[str, Any]], peak: float | None) -> str:
    """The one table: a row per variant, in the order run (adds the derived figures)."""
    cols = (
        "variant",
        "ms/step",
        "vs plain DP",
        "tokens/s",
        "MFU",
        "compile s",
        "coll MiB",
        "layout copies",
        "copies MiB",
        "temp MiB",
        "peak GiB",
    )
    _derive(results, peak)
    rows = [cols] + [_row(r) for r in results]
    widths = [max(len(row[i]) for row in rows) for i in range(len(cols))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in rows]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def _write(out: str | None, args: argparse.Namespace, results: list, peak: Any) -> None:
    if out:
        _derive(results, peak)
        summary = {
            "args": vars(args),
            "peak_flops_per_device": peak,
            "variants": {r["variant"]: r for r in results},
        }
        (Path(out) / f"gpu_{args.name}.json").write_text(json.dumps(summary, indent=2))


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    args.stages = (
        _memory_wall_order(args.stages) if set(args.stages) & set(MEMORY_WALL) else args.stages
    )
    if args.variant:
        Path(args.result).write_text(json.dumps(run_variant(args)))
        return 0
    start = time.monotonic()
    env = dict(os.environ)
    if args.smoke:  # a crash check: cheaper CPU code generation (compile time rules there)
        env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {SMOKE_XLA_FLAGS}".strip()
    out = os.environ.get("OUT")
    results: list[dict[str, Any]] = []
    peak: float | None = args.peak_flops
    print(
        f"jzero {args.name.replace('_', '-')} check: GPT {args.layers} layers, "
        f"d_model {args.d_model}, "
        f"{args.heads} heads, seq {args.seq_len}, micro-batch {args.micro_batch} a device, "
        f"bf16, AdamW, clip {CLIP}; variants {', '.join(args.stages)}; "
        f"time budget {args.time_budget:.0f} s",
        flush=True,
    )
    with tempfile.TemporaryDirectory() as tmp:
        for variant in args.stages:
            left = args.time_budget - (time.monotonic() - start)
            if left <= 0:
                results.append(
                    {
                        "variant": variant,
                        "status": "skipped",
                        "note": f"not started: the {args.time_budget:.0f} s time budget is spent",
                    }
                )
                continue
            r = _run_child(args, variant, env, left, tmp)
            if r["status"] == "ok":
                r["flops_per_token"] = flops_per_token(
                    r["params"], args.layers, args.d_model, args.seq_len
                )
                if peak is None:
                    peak = peak_flops(r["device_kind"])
                print(
                    f"{variant}: {r['step_seconds_median'] * 1e3:.1f} ms/step, compile "
                    f"{r['compile_seconds']:.1f} s, losses {r['losses']}",
                    flush=True,
                )
            else:
                print(f"{variant}: {r['status']}: {r['note']}", flush=True)
            results.append(r)
            _write(out, args, results, peak)
    ok = [r for r in results if r["status"] == "ok"]
    if ok:
        first = ok[0]
        print(
            f"\n{first['params']:,} parameters, {first['devices']} x {first['device_kind']} "
            f"({first['platform']}), jax {first['jax']}; global batch "
            f"{args.micro_batch * first['devices']} x {args.seq_len} tokens; "
            f"{first['flops_per_token'] / 1e9:.3g} GFLOP a token (6 N + 12 L d T)"
        )
    if peak is None:
        print("peak bf16 FLOP/s: unknown for this device (MFU n/a; --peak-flops sets it)")
    else:
        source = "--peak-flops" if args.peak_flops else "table"
        print(f"peak bf16 FLOP/s a device: {peak:.3g} ({source})")
    print(
        f"ms/step: median of {args.steps} steps after {args.warmup}; coll MiB: collective "
        "bytes a step, all-reduce twice; layout copies: copies/transposes next to a collective; "
        "temp MiB: the compiled step's temporaries (memory_analysis); peak GiB: device 0's "
        "allocator peak"
    )
    print(table(results, peak))
    for r in results:
        if r["status"] != "ok":
            print(f"note: {r['variant']} {r['status']}: {r['note']}")
    _write(out, args, results, peak)
    if out:
        print(f"wrote {Path(out) / f'gpu_{args.name}.json'}")
    failed = [r for r in results if r["status"] in ("failed", "timed out")]
    return 1 if failed or not ok else 0


if __name__ == "__main__":
    sys.exit(main())
