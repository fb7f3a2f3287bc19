"""Sequence parallelism (DeepSpeed-Ulysses): the temporaries per device of one attention block.

Run: ``python benchmarks/sequence_parallel.py [--smoke]`` (8 virtual CPU devices are set up
when ``XLA_FLAGS`` does not name a device count). One attention block (x -> q, k, v
projections -> causal softmax attention -> output projection, no LayerNorm), forward and
backward (``jax.grad`` of the output's sum with respect to the four weights), under
``jax.shard_map`` on the mesh ``{data: 8/S, seq: S}`` with the attention wrapped by
:func:`jzero.distributed.sequence.sequence_parallel_attention`, for ``S`` in {1, 4}. Each
program is only compiled, never run: the figure is ``compiled.memory_analysis()``'s
``temp_size_in_bytes``, the compiler's temporaries per device (activations, the attention
scores, gradients in flight).

Two tables, both at the same 8 devices:

* **global batch 8** (``--batch``): ``S=1`` holds one full sequence per device, ``S=4`` four
  sequences' quarters. Tokens per device are the same, and so are the attention scores
  (``H * T^2`` either way): at a batch data parallelism can still split, Ulysses saves nothing
  in principle. The ~0.75 measured comes from XLA:CPU, which keeps an extra copy of the scores
  for a batch dimension of 1 (``S=1`` here); at two or more sequences per device ``S=1`` and
  ``S=4`` are equal (408 MiB each at ``T=1024``, global batch 32).
* **one sequence per data group** (global batch ``8/S``): the case Ulysses is for, a sequence
  too long for one device with no batch left to split. ``S=4`` holds a quarter of the tokens
  and a quarter of the heads' scores, so its temporaries are ~1/4 of ``S=1``'s.
"""

from __future__ import annotations

import argparse
import os

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    )

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jzero  # noqa: E402
from jzero.distributed.sequence import SEQ_AXIS, sequence_parallel_attention  # noqa: E402

MIB = 1 << 20
DEVICES = 8
SIZES = (1, 4)


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """Softmax attention with a causal mask over ``[B, T, H, Dh]``."""
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
    causal = jnp.tril(jnp.ones((q.shape[1], k.shape[1]), bool))
    scores = jnp.where(causal, scores, -jnp.inf)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v)


def block(params: dict[str, jax.Array], x: jax.Array, heads: int) -> jax.Array:
    """One attention block on this device's tokens ``[B, T/S, D]``."""
    b, t, d = x.shape
    q, k, v = (jnp.reshape(x @ params[n], (b, t, heads, d // heads)) for n in ("q", "k", "v"))
    out = sequence_parallel_attention(causal_attention)(q, k, v)
    return jnp.reshape(out, (b, t, d)) @ params["o"]


def temp_bytes(size: int, batch: int, seq_len: int, d_model: int, heads: int) -> int:
    """The compiled forward + backward's temporaries per device on ``{data: 8/size, seq: size}``."""
    mesh = jzero.make_mesh({"data": DEVICES // size, SEQ_AXIS: size})
    sharded = jax.shard_map(
        lambda p, x: block(p, x, heads),
        mesh=mesh,
        in_specs=(P(), P("data", SEQ_AXIS)),
        out_specs=P("data", SEQ_AXIS),
        axis_names={"data", SEQ_AXIS},
    )
    grad = jax.jit(jax.grad(lambda p, x: jnp.sum(sharded(p, x))))
    params = {n: jax.ShapeDtypeStruct((d_model, d_model), jnp.float32) for n in "qkvo"}
    x = jax.ShapeDtypeStruct((batch, seq_len, d_model), jnp.float32)
    return grad.lower(params, x).compile().memory_analysis().temp_size_in_bytes


def table(title: str, rows: list[tuple[int, int, int]]) -> str:
    lines = [
        f"### {title}",
        "",
        "| seq len | S=1 temp MiB | S=4 temp MiB | ratio |",
        "|---:|---:|---:|---:|",
    ]
    for seq_len, one, four in rows:
        lines.append(f"| {seq_len} | {one / MIB:.1f} | {four / MIB:.1f} | {four / one:.3f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="sequence lengths 64 and 128, d_model 64")
    ap.add_argument("--seq-lens", help="comma-separated (default 1024,2048,4096,8192,16384)")
    ap.add_argument("--batch", type=int, default=8, help="global batch of the first table")
    ap.add_argument("--d-model", type=int, help="model width (default 256, smoke 64)")
    ap.add_argument("--heads", type=int, default=8)
    args = ap.parse_args(argv)
    if jax.device_count() != DEVICES:
        raise SystemExit(
            f"benchmarks/sequence_parallel.py needs {DEVICES} devices, found "
            f"{jax.device_count()}. Set XLA_FLAGS=--xla_force_host_platform_device_count=8."
        )
    default = "64,128" if args.smoke else "1024,2048,4096,8192,16384"
    seq_lens = [int(s) for s in (args.seq_lens or default).split(",")]
    d_model = args.d_model or (64 if args.smoke else 256)
    for title, batch_of in (
        (f"Global batch {args.batch}: mesh {{data: 8/S, seq: S}}", lambda s: args.batch),
        ("One sequence per data group: global batch 8/S", lambda s: DEVICES // s),
    ):
        rows = [
            (t, *(temp_bytes(s, batch_of(s), t, d_model, args.heads) for s in SIZES))
            for t in seq_lens
        ]
        print(table(f"{title} (d_model {d_model}, {args.heads} heads, float32, fwd+bwd)", rows))
        print()


if __name__ == "__main__":
    main()
