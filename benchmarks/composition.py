"""Every parallelism beside every other on 8 devices: per layout, the model state and the compiled
step's temporaries per device, and the bytes a step moves on each mesh axis.

Run: ``python benchmarks/composition.py`` (8 virtual CPU devices are set up when no accelerator
is present; ``--smoke`` for a tiny GPT and two layouts). The layouts are plain ZeRO on
``{data: 8}``, then tensor (``model``), sequence (``seq``), pipeline (``pipe``), experts
(``expert``) and hybrid sharding (``replica``), two and three at a time, each axis of 2 (the
rest ``data``), at ``--stage`` (default 3); and tensor x experts once more with each expert's
MLP split over ``model`` too (DeepSpeed's expert tensor parallelism, by ``tp_plan``). Layouts
with ``expert`` train the MoE GPT (``--experts`` experts, top-2, in every block), the others
the dense GPT of the same shape; a pipelined layout runs 2 micro-batches a step (the others 1),
the global batch the same everywhere. ``--only 3,11`` measures those rows alone.

Each row is one layout, read from the plan and the compiled program (nothing runs):

* state: per-device bytes of params, gradients and optimizer state
  (``model_state_bytes(engine.plan)``);
* temp: ``engine.lower(batch).compile().memory_analysis().temp_size_in_bytes``;
* model / seq / pipe / expert / replica: full-buffer bytes a step of the collectives whose
  device groups span that axis only (``jzero.hlo.collectives_by_axes``, loops counted by trip
  count; '-': no such axis); ZeRO: those spanning ``data`` or several of ZeRO's axes
  (``data`` with ``seq`` and ``expert`` where they are ZeRO's too); other: any other
  combination (scalars: the loss, norms).

The seq and expert axes are ZeRO axes as well (DeepSpeed shards over its sequence-parallel
ranks and each expert's data-parallel group): their own column holds what spans them alone
(their all-to-alls, and ZeRO's collectives when ``data`` has one device).
"""

from __future__ import annotations

import argparse
import itertools
import os

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    )

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import jzero  # noqa: E402
from jzero.demo import gpt  # noqa: E402
from jzero.hlo import collectives_by_axes  # noqa: E402
from jzero.plan import model_state_bytes  # noqa: E402

MB = 1 << 20
AXES = ("model", "seq", "pipe", "expert", "replica")
OWN = ("model", "seq", "pipe", "expert", "replica")
SPLIT = "experts split"  # a layout's marker: each expert's MLP split over `model` too
EXPERT_TP_PLAN = gpt.EXPERT_TP_PLAN  # DeepSpeed's expert tensor parallelism, by tp_plan


def layouts(smoke: bool) -> list[tuple[str, ...]]:
    if smoke:
        return [(), ("model", "pipe", "expert")]
    pairs = list(itertools.combinations(AXES, 2))
    return [(), *pairs, ("model", "expert", SPLIT), *itertools.combinations(AXES, 3)]


def config(axes: tuple[str, ...], stage: int, batch: int) -> dict:
    on = set(axes)
    return {
        "train_batch_size": batch,
        "gradient_accumulation_steps": 2 if "pipe" in on else 1,
        "zero_optimization": {"stage": stage},
        "tensor_parallel": {"autotp_size": 2 if "model" in on else 1},
        "sequence_parallel_size": 2 if "seq" in on else 1,
        "pipeline": {"stages": 2 if "pipe" in on else 1},
        "expert_parallel": {"autoep_size": 2 if "expert" in on else 1},
        **({"mesh": {"replica": 2}} if "replica" in on else {}),
    } | ({"tensor_parallel": {"autotp_size": 2, "tp_plan": EXPERT_TP_PLAN}} if SPLIT in on else {})


def measure(cfg: gpt.GPTConfig, axes: tuple[str, ...], stage: int, batch: int) -> dict:
    """One layout's row: bytes per device of model state and temporaries, bytes per axis."""
    params = jax.eval_shape(lambda: gpt.init_params(jax.random.key(0), cfg))
    params = jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), params)
    engine = jzero.initialize(
        params, lambda p, b: gpt.loss_fn(p, b, cfg), optax.adamw(1e-3), config(axes, stage, batch)
    )
    tokens = np.zeros((batch, cfg.seq_len + 1), np.int32)
    compiled = engine.lower({"tokens": tokens}).compile()
    by_axes = collectives_by_axes(compiled, engine.mesh)
    state_axes = set(engine.plan.state_axes)

    def spans(axes_: tuple[str, ...]) -> int:
        return sum(s.bytes for s in by_axes.get(axes_, {}).values())

    own = {a: spans((a,)) for a in OWN if engine.mesh.shape.get(a, 1) > 1}
    zero = [a for a in by_axes if a and set(a) <= state_axes and (len(a) > 1 or a[0] not in own)]
    named = {*zero, *((a,) for a in own)}
    engine.close()
    return {
        "layout": (" x ".join(a for a in axes if a in AXES) or "data only")
        + (f" ({SPLIT} over model)" if SPLIT in axes else ""),
        "mesh": dict(engine.mesh.shape),
        "state": sum(model_state_bytes(engine.plan, engine.accumulation_steps).values()),
        "temp": compiled.memory_analysis().temp_size_in_bytes,
        "zero": sum(spans(a) for a in zero),
        **own,
        "other": sum(spans(a) for a in by_axes if a not in named),
    }


def table(rows: list[dict]) -> str:
    head = ["layout", "mesh", "state MiB", "temp MiB", "ZeRO MiB", *(f"{a} MiB" for a in OWN)]
    head.append("other MiB")
    lines = []
    for r in rows:
        mesh = "{" + ", ".join(f"{k}: {v}" for k, v in r["mesh"].items()) + "}"
        cells = [r["layout"], mesh, *(f"{r[k] / MB:.2f}" for k in ("state", "temp", "zero"))]
        cells += ["-" if a not in r else f"{r[a] / MB:.2f}" for a in OWN]
        cells.append(f"{r['other'] / MB:.3f}")
        lines.append(cells)
    widths = [max(len(str(x)) for x in col) for col in zip(head, *lines, strict=True)]
    out = ["  ".join(h.ljust(w) for h, w in zip(head, widths, strict=True))]
    out.append("-" * len(out[0]))
    out += ["  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)) for cells in lines]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=16, help="global batch (rows), every layout")
    ap.add_argument("--experts", type=int, default=4, help="experts a block in MoE layouts")
    ap.add_argument("--stage", type=int, default=3, choices=[1, 2, 3])
    ap.add_argument("--smoke", action="store_true", help="a tiny GPT, two layouts")
    ap.add_argument("--only", help="comma-separated layout numbers (0: data only) to measure")
    args = ap.parse_args(argv)
    if args.smoke:
        args.layers, args.d_model, args.heads, args.seq_len, args.vocab = 2, 32, 4, 16, 64
        args.batch = 8
    shape = {
        "vocab_size": args.vocab,
        "seq_len": args.seq_len,
        "num_layers": args.layers,
        "num_heads": args.heads,
        "d_model": args.d_model,
        "d_ff": 4 * args.d_model,
    }
    dense = gpt.GPTConfig(**shape)
    moe = gpt.GPTConfig(**shape, num_experts=args.experts, experts_per_token=2)
    rows = []
    chosen = layouts(args.smoke)
    if args.only:
        chosen = [chosen[int(i)] for i in args.only.split(",")]
    for axes in chosen:
        rows.append(measure(moe if "expert" in axes else dense, axes, args.stage, args.batch))
    print(
        f"Composed layouts on {jax.device_count()} devices, ZeRO stage {args.stage}: GPT "
        f"{args.layers} layers, d_model {args.d_model}, {args.heads} heads, seq {args.seq_len}, "
        f"batch {args.batch} (MoE layouts: {args.experts} experts, top-2, every block)"
    )
    print(table(rows))
    print(
        "state: params + grads + optimizer state per device (the plan); temp: the compiled "
        "step's temporaries per device; ZeRO: collectives spanning ZeRO's axes; <axis>: "
        "collectives within that axis only ('-': no such axis); "
        "bytes are full buffers a step."
    )


if __name__ == "__main__":
    main()
