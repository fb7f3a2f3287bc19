"""A user's own Flax NNX model for ``jzero train --model tests/support/user_model.py:make``: a
token embedding and a head (a bigram model), its loss reading the packed rows' segment ids.

Its parameters are float64 when x64 is on (the tests that compare losses at 1e-10), float32
otherwise.
"""

import jax
import jax.numpy as jnp
from flax import nnx


class Bigram(nnx.Module):
    def __init__(self, vocab_size: int, d_model: int, rngs: nnx.Rngs):
        dtype = jnp.float64 if jax.config.jax_enable_x64 else jnp.float32
        self.embed = nnx.Embed(vocab_size, d_model, rngs=rngs, param_dtype=dtype)
        self.head = nnx.Linear(d_model, vocab_size, rngs=rngs, param_dtype=dtype)

    def __call__(self, tokens):
        return self.head(self.embed(tokens))


def loss_fn(model, batch):
    """Next-token cross-entropy over the targets that continue their input's document."""
    tokens, seg = batch["tokens"], batch["segment_ids"]
    logits = model(tokens[:, :-1])
    picked = jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[:, 1:, None], -1)[..., 0]
    keep = (seg[:, 1:] == seg[:, :-1]) & (seg[:, 1:] != 0)
    return -jnp.where(keep, picked, 0.0).sum() / picked.size


def make(vocab_size: int, seq_len: int, d_model: int, seed: int = 0):
    del seq_len  # the data's rows; the model takes any length
    return {"model": Bigram(vocab_size, d_model, nnx.Rngs(seed)), "loss_fn": loss_fn}
