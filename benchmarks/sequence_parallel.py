"""Sequence parallelism (DeepSpeed-Ulysses): the built-in GPT's temporaries per device against
the sequence length, with and without ``sequence_parallel_size: 4``.

Run: ``python benchmarks/sequence_parallel.py [--smoke]`` (8 virtual CPU devices are set up
when ``XLA_FLAGS`` does not name a device count). For each sequence length the built-in GPT
(one layer by default, float32, AdamW at ZeRO stage 1) is built by ``jzero.initialize`` as
``jzero train`` builds it, with ``sequence_parallel_size`` S in {1, 4} on the mesh
``{data: 8/S, seq: S}``, and its whole train step (forward, backward, reduction, update) is
compiled, never run: the figure is ``compiled.memory_analysis().temp_size_in_bytes``, the
compiler's temporaries per device (activations, the attention scores, gradients in flight).
The model runs its plain forms (``attention_block`` the length, ``loss_chunk`` 0), so the
figures are Ulysses's alone; ``benchmarks/long_sequence.py`` measures the blockwise ones.

Two tables, both on the same 8 devices:

* **one sequence per data group** (``train_batch_size`` 8/S, one row per data group): the case
  Ulysses is for, a sequence too long for one device and no batch left to split. At S=4 each
  device holds a quarter of the tokens outside attention and a quarter of the heads' scores
  inside it, so its temporaries are about a quarter of S=1's.
* **the same global batch** (``--batch``, 8): S=1 holds one whole sequence per device, S=4 a
  quarter of four. Tokens per device and the attention scores per device (H T^2 / S per
  sequence x S sequences) are the same, so at a batch data parallelism can still split,
  Ulysses saves nothing in principle: it is for the sequence that does not fit. (Measured:
  0.76-0.95x; the remainder is how XLA:CPU lays out a one-row batch, which S=1 has here: in
  an attention-only measurement at two rows a device, S=1 and S=4 were equal.)
"""

from __future__ import annotations

import argparse
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

MIB = 1 << 20
DEVICES = 8
SIZES = (1, 4)


def temp_bytes(seq: int, batch: int, cfg: gpt.GPTConfig) -> int:
    """The compiled train step's temporaries per device at ``sequence_parallel_size: seq``."""
    engine = jzero.initialize(
        lambda key: gpt.init_params(key, cfg),
        lambda p, b: gpt.loss_fn(p, b, cfg),
        optax.adamw(1e-3),
        {
            "train_batch_size": batch,
            "zero_optimization": {"stage": 1},
            "sequence_parallel_size": seq,
        },
        abstract=True,  # compiled only: the state's shapes are enough
    )
    tokens = jax.ShapeDtypeStruct((batch, cfg.seq_len + 1), np.int32)
    return engine.lower({"tokens": tokens}).compile().memory_analysis().temp_size_in_bytes


def table(title: str, rows: list[tuple[int, int, int]]) -> str:
    lines = [
        f"### {title}",
        "",
        "| seq len | S=1 temp MiB | S=4 temp MiB | S=4 / S=1 |",
        "|---:|---:|---:|---:|",
    ]
    for seq_len, one, four in rows:
        lines.append(f"| {seq_len} | {one / MIB:.1f} | {four / MIB:.1f} | {four / one:.3f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--smoke", action="store_true", help="sequence length 64, d_model 32, the first table"
    )
    ap.add_argument("--seq-lens", help="comma-separated (default 1024,2048,4096,8192,16384)")
    ap.add_argument("--batch", type=int, default=8, help="global batch of the second table")
    ap.add_argument("--d-model", type=int, help="model width (default 256, smoke 32)")
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--layers", type=int, default=1)
    args = ap.parse_args(argv)
    if jax.device_count() != DEVICES:
        raise SystemExit(
            f"benchmarks/sequence_parallel.py needs {DEVICES} devices, found "
            f"{jax.device_count()}. Set XLA_FLAGS=--xla_force_host_platform_device_count=8."
        )
    default = "64" if args.smoke else "1024,2048,4096,8192,16384"
    seq_lens = [int(s) for s in (args.seq_lens or default).split(",")]
    d_model = args.d_model or (32 if args.smoke else 256)
    shape = f"GPT {args.layers} layer(s), d_model {d_model}, {args.heads} heads, float32"
    tables = (
        ("One sequence per data group: train_batch_size 8/S", lambda s: DEVICES // s),
        (f"Global batch {args.batch}: mesh {{data: 8/S, seq: S}}", lambda s: args.batch),
    )
    for title, batch_of in tables[:1] if args.smoke else tables:
        rows = []
        for t in seq_lens:
            # The plain forms (whole scores and logits): what Ulysses splits, measured alone;
            # benchmarks/long_sequence.py measures the blockwise and tiled forms.
            cfg = gpt.GPTConfig(
                vocab_size=256, seq_len=t, num_layers=args.layers, num_heads=args.heads,
                d_model=d_model, d_ff=4 * d_model, attention_block=t, loss_chunk=0,
            )  # fmt: skip
            rows.append((t, *(temp_bytes(s, batch_of(s), cfg) for s in SIZES)))
        print(table(f"{title} ({shape}, train step)", rows))
        print()


if __name__ == "__main__":
    main()
