"""A transformer's activation bytes per device with each long-context technique, and the longest
sequence that fits a budget.

Decisions:

* The terms are Korthikanti et al. 2022's ("Reducing Activation Recomputation in Large
  Transformer Models", arXiv:2205.05198, section 4), kept apart so that each technique takes
  out its own. Per layer and device, with ``x = s b h / (S C)`` (the device's tokens times the
  hidden size; S the ``seq`` axis, C the ``context`` axis) and ``e`` bytes an activation
  element:

  - *whole on every device of the model axis* t: the two LayerNorms' inputs and the QKV and
    MLP matmuls' inputs, ``4 e x``;
  - *split over t*: Q, K, V and the attention's output, ``4 e x / t``, and the MLP's
    ``[s, 4h]`` intermediate before and after its activation, ``8 e x / t``;
  - *plain attention*: the softmax's ``[s, s]`` output per head, ``e a s^2 b / (t S)`` (under
    Ulysses a device holds ``a / S`` heads of the whole sequence);
  - *blockwise (flash-style) attention*: no ``[s, s]`` value; the scores are recomputed block
    by block in the backward pass from Q, K, V and the softmax's log-sum-exp, one float32 a
    head and token, ``4 a x / (h t)``;
  - *dropout*, only when the model has it (jzero's built-in GPT has none): 1-byte masks after
    the attention and the MLP, ``2 x``; plain attention also keeps the scores' mask and the
    dropped-out probabilities, ``(e + 1) a s^2 b / (t S)``; blockwise attention regenerates
    its mask from the seed.

  With dropout and plain attention this is the paper's ``s b h (34 + 5 a s / h)`` in 16-bit
  (:func:`jzero.costs.transformer_activations` is that case).
* The loss: the float32 logits ``[s, V]`` kept for the backward pass, ``4 s b V / (t S C)``
  (the head vocabulary-parallel over the model axis); the tiled loss keeps one chunk of ``c``
  tokens, ``4 min(c, s / (S C)) b V / t``. Counted once: the head follows the last layer,
  outside any checkpointed layer; without ``vocab`` the loss is not counted.
* The tiled MLP computes the intermediate chunk by chunk under rematerialisation, so a layer
  keeps only the MLP's input (already counted); one chunk's intermediate is live while it is
  recomputed, ``8 e min(c, s / (S C)) b h / t``, once a device.
* Checkpointing ``full`` keeps each layer's input, ``e x`` (whole on the model axis), and
  rebuilds one layer at a time in the backward pass. Activation offload (the config's
  ``activation_checkpointing.cpu_checkpointing``) moves those inputs to host memory: the
  device keeps the one in flight, the host ``L e x``. It needs ``full`` (with no checkpointing
  nothing is saved to move).
* Ring attention (the ``context`` axis C) splits every term's tokens by C and always computes
  by blocks (each ring step attends one block of keys), whatever ``attention`` says.
* A pipeline stage runs ``L / P`` layers and holds ``in_flight`` micro-batches of them (its
  schedule's table); the loss is counted once, as on the last stage.
* Not counted: the embeddings, the final LayerNorm, blockwise attention's one block of scores
  (``b a / t`` block x block float32, the same at every s), the collectives' buffers.
* :func:`longest_sequence` bisects over multiples of a step: every term grows with s, so the
  need is monotone.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from jzero.costs.shapes import ModelShape, ParallelDims

__all__ = [
    "ATTENTIONS",
    "CHECKPOINTING",
    "ActivationBytes",
    "activation_bytes",
    "longest_sequence",
    "sequence_step",
]

ATTENTIONS = ("plain", "blockwise")
"""The attention kinds: ``plain`` keeps the ``[s, s]`` scores, ``blockwise`` none."""
CHECKPOINTING = ("none", "full")
"""The checkpointing policies counted: nothing rematerialised, or only each layer's input kept."""
_ELEMENT_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
_LSE_BYTES = 4  # the blockwise softmax's log-sum-exp, float32
_LOGIT_BYTES = 4  # the logits, float32


@dataclass(frozen=True)
class ActivationBytes:
    """Activation bytes of one device: its layers', its loss's, and those it keeps in host
    memory."""

    layers: float
    """Bytes the device's layers keep (with checkpointing: the layer inputs left on the device
    and the one layer rebuilt in the backward pass)."""
    loss: float = 0.0
    """Bytes of the logits (one chunk of them under the tiled loss), and of the tiled MLP's
    chunk in flight."""
    host: float = 0.0
    """Bytes in host memory: the offloaded layer inputs."""

    @property
    def device(self) -> float:
        """Bytes on the device: :attr:`layers` + :attr:`loss`."""
        return self.layers + self.loss


def _tokens(model: ModelShape, layout: ParallelDims) -> float:
    """The device's tokens of one row, ``s / (S C)``."""
    return model.seq_len / (layout.seq * layout.context)


def _layer(model: ModelShape, layout: ParallelDims, e: float) -> float:
    """Bytes one layer keeps for the backward pass without checkpointing."""
    techniques = model.techniques
    s, b, h, a = model.seq_len, layout.micro_batch, model.hidden, model.heads
    t, sp = layout.model, layout.seq
    x = _tokens(model, layout) * b * h
    mlp = 0.0 if techniques.mlp_chunk else 8 * e * x / t
    out = 4 * e * x + 4 * e * x / t + mlp
    blockwise = techniques.attention == "blockwise" or layout.context > 1
    if blockwise:
        out += _LSE_BYTES * a * x / (h * t)
    else:
        out += e * a * s * s * b / (t * sp)
    if techniques.dropout:
        out += 2 * x
        if not blockwise:
            out += (e + 1) * a * s * s * b / (t * sp)
    return out


def _loss(model: ModelShape, layout: ParallelDims, e: float) -> float:
    """The logits' bytes (one chunk under the tiled loss) and the tiled MLP's live chunk."""
    techniques = model.techniques
    n, b, t = _tokens(model, layout), layout.micro_batch, layout.model
    out = 0.0
    if model.vocab:
        rows = min(techniques.loss_chunk, n) if techniques.loss_chunk else n
        out += _LOGIT_BYTES * rows * b * model.vocab / t
    if techniques.mlp_chunk:
        out += 8 * e * min(techniques.mlp_chunk, n) * b * model.hidden / t
    return out


def activation_bytes(
    model: ModelShape,
    layout: ParallelDims,
    *,
    checkpointing: Literal["none", "full"] = "none",
    dtype: str = "bf16",
    in_flight: float = 1.0,
) -> ActivationBytes:
    """Activation bytes of one device of a transformer (the module's terms), with the model's
    :class:`~jzero.costs.Techniques`.

    Args:
      model: the transformer's ``seq_len`` s, ``hidden`` h, ``layers`` L, ``heads`` a,
        ``vocab`` V (``None``: the loss is not counted) and ``techniques`` (the attention
        kind, dropout, tiled loss and MLP, activation offload; by default
        :data:`~jzero.costs.PAPER`, Korthikanti et al.'s plain attention with dropout).
      layout: the micro batch b, the ``model`` axis t, ``seq`` S (Ulysses), ``context`` C (ring
        attention) and ``pipe`` P (a stage runs ``L / P`` layers).
      checkpointing: ``"none"`` or ``"full"`` (each layer's input kept, one layer rebuilt).
      dtype: the activations' dtype, ``"bf16"``, ``"fp16"`` or ``"fp32"``.
      in_flight: micro-batches of its layers' activations a pipeline stage holds.

    Returns:
      The device's and the host's bytes (:class:`ActivationBytes`).

    Raises:
      ValueError: ``checkpointing`` or ``techniques.attention`` not one of the choices, or
        activation offload without checkpointing ``full``.

    Example:
      >>> from dataclasses import replace
      >>> from jzero.costs import Techniques
      >>> model = ModelShape(7e9, seq_len=4096, hidden=4096, layers=32, heads=32, vocab=32000)
      >>> layout = ParallelDims(8, micro_batch=1)
      >>> plain = activation_bytes(replace(model, techniques=Techniques()), layout)
      >>> tiled = Techniques("blockwise", loss_chunk=1024)
      >>> flash = activation_bytes(replace(model, techniques=tiled), layout)
      >>> round(plain.device / 2**30, 2), round(flash.device / 2**30, 2)  # GiB
      (48.49, 16.14)
    """
    techniques = model.techniques
    if checkpointing not in CHECKPOINTING:
        raise ValueError(
            f"checkpointing: {checkpointing!r} is not allowed; it must be one of "
            f"{', '.join(CHECKPOINTING)}."
        )
    if techniques.attention not in ATTENTIONS:
        raise ValueError(
            f"attention: {techniques.attention!r} is not allowed; it must be one of "
            f"{', '.join(ATTENTIONS)}."
        )
    if techniques.offload and checkpointing != "full":
        raise ValueError(
            "Activation offload moves the checkpointed layer inputs to host memory, but "
            f"checkpointing is {checkpointing!r}, which saves none; pass checkpointing='full' "
            "or offload=False."
        )
    e = _ELEMENT_BYTES[dtype]
    layers = model.layers / layout.pipe
    per_layer = _layer(model, layout, e)
    loss = _loss(model, layout, e)
    if checkpointing == "none":
        return ActivationBytes(layers * per_layer * in_flight, loss)
    inputs = layers * e * _tokens(model, layout) * layout.micro_batch * model.hidden * in_flight
    if techniques.offload:  # the device keeps the input in flight to the host
        one = inputs / (layers * in_flight)
        return ActivationBytes(one + per_layer, loss, inputs)
    return ActivationBytes(inputs + per_layer, loss)


def sequence_step(layout: ParallelDims) -> int:
    """The sequence lengths a layout takes are multiples of this: ``S`` (Ulysses's tokens split
    evenly), times ``2 C`` with ring attention (its zig-zag cuts the sequence into ``2 C``
    chunks)."""
    return layout.seq * (2 * layout.context if layout.context > 1 else 1)


def longest_sequence(
    need: Callable[[int], float], budget: float, step: int = 1, limit: int = 2**40
) -> int:
    """The largest multiple ``s`` of ``step`` with ``need(s) <= budget``, for ``need``
    nondecreasing in s; 0 when ``step`` does not fit, ``limit`` (rounded down to a step) when
    that still fits.

    Example:
      >>> longest_sequence(lambda s: 3 * s * s, 100)  # 3 x 5^2 = 75 fits, 3 x 6^2 = 108 not
      5
      >>> longest_sequence(lambda s: 3 * s * s, 100, step=4)
      4
    """
    top = limit // step
    if top < 1 or need(step) > budget:
        return 0
    lo, hi = 1, 2  # lo fits, hi is the next guess (in steps)
    while hi <= top and need(hi * step) <= budget:
        lo, hi = hi, 2 * hi
    hi = min(hi, top + 1)  # hi does not fit (or is past the limit)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if need(mid * step) <= budget:
            lo = mid
        else:
            hi = mid
    return lo * step
