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
"""

from __future__ import annotations

import argparse
import dataclasses

import jax
import numpy as np

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


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="length 64, a tiny model, blocks of 16")
    ap.add_argument("--seq-lens", help="comma-separated (default 1024,2048,4096,8192)")
    args = ap.parse_args(argv)
    if args.smoke:
        base = gpt.GPTConfig(vocab_size=512, num_layers=1, num_heads=2, d_model=32, d_ff=128)
        block, chunk, default = 16, 16, "64"
    else:
        base = gpt.GPTConfig(vocab_size=32000, num_layers=1, num_heads=8, d_model=256, d_ff=1024)
        block, chunk, default = 512, 1024, "1024,2048,4096,8192"
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
