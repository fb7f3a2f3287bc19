"""The shapes of today's decoder-only transformers, their parameter counts and largest layers.

Decisions:

* An :class:`Architecture` names what decides the parameter count: hidden size, layers,
  attention heads and key/value heads (grouped-query attention), the MLP's width and kind
  (SwiGLU: three ``h x ffn`` matrices; GELU: two), the norm (RMSNorm: a scale; LayerNorm:
  a scale and a bias), the positions (rotary: no parameters; learned: a table), biases,
  tied or untied embeddings, the vocabulary and the experts of a mixture of experts.
  :meth:`Architecture.model_shape` turns it into the :class:`~jzero.costs.ModelShape` the
  cost formulas read, so ``jzero estimate --preset`` and a hand-written shape meet there.
* Two largest layers, because the two estimators mean different things by it: jzero's
  stage 3 gathers each leaf apart, one layer's slice of a stacked leaf at a time, so its
  largest layer is the largest matrix a step gathers whole: the embedding, the head, one
  layer's MLP matrix (all its experts', which are one leaf)
  (:meth:`Architecture.largest_layer_params`, what ``jzero plan`` measures as "gathered");
  DeepSpeed's estimator takes the largest ``torch.nn.Module``'s own parameters, one expert's
  matrix at most (:meth:`Architecture.largest_module_params`).
* :data:`PRESETS` holds a few published shapes; their parameter counts are checked against
  the published figures in the tests (within 1%).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from jzero.costs.shapes import ModelShape, Techniques

__all__ = ["PRESETS", "Architecture"]


@dataclass(frozen=True)
class Architecture:
    """A decoder-only transformer's shape, as far as its parameters go."""

    hidden: int
    """Hidden size h."""
    layers: int
    """Transformer blocks L."""
    heads: int
    """Query heads a; the head size is ``h / a``."""
    ffn: int
    """The MLP's intermediate width (``4 h`` in GPT-2, ``3.5 h`` in Llama-3)."""
    vocab: int
    """Vocabulary size V."""
    kv_heads: int | None = None
    """Key/value heads (grouped-query attention); ``None``: as many as ``heads``."""
    mlp: Literal["swiglu", "gelu"] = "swiglu"
    """``"swiglu"``: gate, up and down matrices; ``"gelu"``: up and down."""
    norm: Literal["rmsnorm", "layernorm"] = "rmsnorm"
    """``"rmsnorm"``: a scale a norm; ``"layernorm"``: a scale and a bias."""
    positions: Literal["rotary", "learned"] = "rotary"
    """``"rotary"``: no parameters; ``"learned"``: a ``max_positions x h`` table."""
    max_positions: int = 0
    """Rows of the learned position table (``positions="learned"``)."""
    bias: Literal["none", "qkv", "all"] = "none"
    """Biases of the linear layers: none (Llama), on the query, key and value projections
    only (Qwen2), or on every linear layer (GPT-2)."""
    tied: bool = False
    """Whether the output head is the embedding matrix (no parameters of its own)."""
    experts: int = 0
    """Experts E of each block's MLP (a mixture of experts with a router); 0: a dense MLP."""
    experts_per_token: int = 2
    """The experts each token is routed to, k."""

    @property
    def head_dim(self) -> int:
        """The size of one head, ``h / a``."""
        return self.hidden // self.heads

    def _norm_params(self) -> int:
        return self.hidden * (1 if self.norm == "rmsnorm" else 2)

    def attention_params(self) -> int:
        """One block's attention: query and output ``h x h``, key and value ``h x kv d``."""
        h, kv = self.hidden, (self.kv_heads or self.heads) * self.head_dim
        weights = 2 * h * h + 2 * h * kv
        biases = {"none": 0, "qkv": h + 2 * kv, "all": 2 * h + 2 * kv}[self.bias]
        return weights + biases

    def mlp_params(self) -> int:
        """One MLP (one expert of a mixture)."""
        h, f = self.hidden, self.ffn
        matrices = 3 if self.mlp == "swiglu" else 2
        biases = (f * (matrices - 1) + h) if self.bias == "all" else 0
        return matrices * h * f + biases

    def block_params(self) -> int:
        """One transformer block: attention, its MLP (every expert, and the router) and two
        norms."""
        mlp = self.mlp_params() * max(self.experts, 1)
        router = self.hidden * self.experts
        return self.attention_params() + mlp + router + 2 * self._norm_params()

    def embedding_params(self) -> int:
        """The token embedding, the learned positions, the head unless tied, the final norm."""
        h = self.hidden
        positions = self.max_positions * h if self.positions == "learned" else 0
        head = 0 if self.tied else self.vocab * h
        return self.vocab * h + positions + head + self._norm_params()

    def params(self) -> int:
        """The parameter count Psi."""
        return self.layers * self.block_params() + self.embedding_params()

    def expert_params(self) -> int:
        """Psi_e, the parameters of all the experts of all blocks (0 without experts)."""
        return self.layers * self.experts * self.mlp_params()

    def largest_layer_params(self) -> int:
        """What jzero's stage 3 gathers at once: the largest leaf (a stacked leaf's one-layer
        slice): the embedding or head ``V x h``, or one layer's MLP matrix ``h x ffn`` (``E h
        ffn`` with experts, one leaf), or the attention's ``h x h``."""
        h = self.hidden
        return max(self.vocab * h, h * self.ffn * max(self.experts, 1), h * h)

    def largest_module_params(self) -> int:
        """DeepSpeed's ``largest_layer_params``: the largest module's own parameters, one
        linear layer (one expert's ``h x ffn``, the attention's ``h x h``) or the embedding."""
        h = self.hidden
        return max(self.vocab * h, h * self.ffn, h * h)

    def model_shape(
        self, seq_len: int | None = None, techniques: Techniques | None = None
    ) -> ModelShape:
        """The :class:`~jzero.costs.ModelShape` the cost formulas read: the parameter count,
        jzero's largest layer, the shape and the experts.

        Args:
          seq_len: the sequence length s, for the activation terms (``None``: not counted,
            and the shape left out with them).
          techniques: how the layers keep their activations (``None``: what jzero runs,
            blockwise attention without dropout).
        """
        return ModelShape(
            float(self.params()),
            largest_layer_params=float(self.largest_layer_params()),
            largest_module_params=float(self.largest_module_params()),
            seq_len=seq_len,
            hidden=self.hidden if seq_len else None,
            layers=self.layers if seq_len else None,
            heads=self.heads if seq_len else None,
            vocab=self.vocab if seq_len else None,
            techniques=techniques or Techniques("blockwise"),
            experts=self.experts,
            expert_params=float(self.expert_params()),
            experts_per_token=self.experts_per_token,
        )


PRESETS: dict[str, Architecture] = {
    "llama-2-7b": Architecture(4096, 32, 32, 11008, 32000),
    "llama-3-8b": Architecture(4096, 32, 32, 14336, 128256, kv_heads=8),
    "llama-3-70b": Architecture(8192, 80, 64, 28672, 128256, kv_heads=8),
    "qwen2.5-7b": Architecture(3584, 28, 28, 18944, 152064, kv_heads=4, bias="qkv"),
    "mixtral-8x7b": Architecture(4096, 32, 32, 14336, 32000, kv_heads=8, experts=8),
}
"""Published shapes by name (``jzero estimate --preset``): Llama-2-7B, Llama-3-8B and -70B,
Qwen2.5-7B and Mixtral-8x7B (8 experts, 2 a token)."""
