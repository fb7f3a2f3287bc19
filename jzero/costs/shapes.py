"""The values the cost formulas read: the model's shape, the parallel layout of the devices
(the mesh's axes and their sizes), and the dtypes the states and activations are counted in.

Decisions:

* One value per thing, whoever asks: :func:`jzero.memory.estimate` and the auto layout
  (:mod:`jzero.engine.auto_layout`) both describe a model by a :class:`ModelShape` and a mesh
  by a :class:`ParallelDims`.
* :class:`ParallelDims` names the axes as the mesh does (``replica``, ``pipe``, ``data``,
  ``expert``, ``context``, ``seq``, ``model``, :func:`jzero.make_mesh`'s order from the major
  axis) and is given the device count: ``data`` is what the other axes leave, as ``data: -1``
  in the config.
  The sizes derived from the axes (the data-parallel degree, ZeRO's group) are its properties,
  so no caller multiplies axes again.
* The values hold what they are given and check nothing: the estimate checks each one and
  names the bad value and its fix (a count such as ``"7.5B"`` is read there too).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

__all__ = ["AXES", "PAPER", "Dtypes", "ModelShape", "ParallelDims", "Techniques"]

AXES = ("replica", "pipe", "data", "expert", "context", "seq", "model")
"""The mesh's axes from the major (across hosts first) to the minor one."""


@dataclass(frozen=True)
class Techniques:
    """How a transformer keeps its activations: the attention kind, dropout and the tiled
    loss, tiled MLP and activation offload (the checkpointing policy and the sequence splits
    are apart: :func:`jzero.costs.activation_bytes`'s ``checkpointing``, the layout's ``seq``
    and ``context``)."""

    attention: Literal["plain", "blockwise"] = "plain"
    """``"plain"``: the softmax's ``[s, s]`` scores are kept for the backward pass;
    ``"blockwise"`` (flash-style): none, only a log-sum-exp a head and token."""
    dropout: bool = False
    """Whether the model applies dropout, whose 1-byte masks are kept."""
    loss_chunk: int = 0
    """Tokens of one chunk of the tiled loss: the ``[s, V]`` logits are never whole, one chunk
    is; 0: the whole logits."""
    mlp_chunk: int = 0
    """Tokens of one chunk of the tiled MLP: the ``[s, 4h]`` intermediate is recomputed chunk
    by chunk; 0: the whole intermediate is kept."""
    offload: bool = False
    """Activation offload (``activation_checkpointing.cpu_checkpointing``): the checkpointed
    layer inputs live in host memory; needs checkpointing ``full``."""


PAPER = Techniques(dropout=True)
"""Korthikanti et al.'s accounting: plain attention with dropout, nothing tiled or offloaded."""


@dataclass(frozen=True)
class ModelShape:
    """What the formulas know of the model: its parameter count, the largest layer stage 3
    gathers whole, the transformer's shape (for the activation term and the per-layer traffic)
    and its experts. ``None``: not known."""

    params: float | str
    """The parameter count Psi, e.g. ``7.5e9`` (the estimate also reads ``"7.5B"``)."""
    largest_layer_params: float = 0
    """Parameters of the largest layer, gathered whole at stage 3."""
    largest_module_params: float | None = None
    """DeepSpeed's ``largest_layer_params``, its largest module's own parameters (one matrix),
    for its estimators' figures; ``None``: ``largest_layer_params``."""
    seq_len: int | None = None
    """Sequence length s."""
    hidden: int | None = None
    """Hidden size h."""
    layers: int | None = None
    """Transformer layers L."""
    heads: int | None = None
    """Attention heads a."""
    vocab: int | None = None
    """Vocabulary size V, for the logits the loss keeps (``None``: not counted)."""
    techniques: Techniques = PAPER
    """How the layers keep their activations (attention kind, dropout, tiled loss and MLP,
    activation offload); :data:`PAPER` by default, Korthikanti et al.'s accounting."""
    experts: int = 0
    """The experts E of each MoE layer; 0: no mixture of experts."""
    expert_params: float | str = 0
    """Psi_e, the parameters of all the experts of all MoE layers, part of ``params`` (a count
    as ``params``, e.g. ``6e9`` or ``"6B"``); needed with ``experts``. They are counted apart
    from the dense Psi_d = Psi - Psi_e, as DeepSpeed shards them: a device holds E/E_p
    experts, Psi_e/E_p parameters, whose states ZeRO shards only over the N/E_p devices of
    their expert data-parallel group (the ``data`` axis), while the dense parameters are
    sharded over all N. Each stage's formula then holds for Psi_d over N plus Psi_e/E_p over
    N/E_p: at stage 3 16 Psi/N as without experts, at stage 1 ``4 (Psi_d + Psi_e/E_p) + 12
    Psi/N``. DeepSpeed's estimators have no such term. With E_p = 1 the totals are those
    without experts."""
    experts_per_token: int = 2
    """The experts each token is routed to, k (the expert axis' all-to-alls carry k copies)."""


@dataclass(frozen=True)
class ParallelDims:
    """How the devices are laid out: how many, per node, each mesh axis' size (``data`` is
    what the others leave), and how a step's batch is cut into micro-batches."""

    devices: int
    """The devices N, all axes together."""
    devices_per_node: int | None = None
    """Devices per node (one host's; host figures are per node, and an axis whose groups
    span more devices than a node crosses hosts); ``None``: the largest divisor of
    ``devices`` up to 8."""
    micro_batch: int | None = None
    """Rows of one micro-batch on one device, b, for the activation terms."""
    replica: int = 1
    """Hybrid sharding's replica groups R (``mesh: {replica: R, data: N/R}``,
    ``mics_shard_size: N/R``): state is sharded within each group of ``N/R`` devices and only
    the gradient shards cross the groups; 1: one group of all N."""
    model: int = 1
    """AutoTP's model axis T (``tensor_parallel.autotp_size``): each device holds ``Psi / T``
    of the dense model, ZeRO-sharded over the ``N / T`` devices of its data group (x ``seq``);
    Megatron's 4 all-reduces of ``s b h`` a layer (2 forward, 2 backward), ``2 (T-1)/T`` of
    the buffer each on a ring."""
    seq: int = 1
    """Ulysses's seq axis S (``sequence_parallel_size``): ZeRO shards over it too (DeepSpeed's
    way), the activations divide by S, and its traffic is 8 all-to-alls of ``s b h / (S T)`` a
    layer, ``(S-1)/S`` each."""
    context: int = 1
    """The context axis C (``context_parallel_size``, ring attention): each device holds
    ``s / C`` tokens of every row, attends the others' keys block by block as they pass
    around the ring, and ZeRO shards over it too; the activations divide by C (no head
    limit, unlike ``seq``)."""
    pipe: int = 1
    """The pipeline stages P (``pipeline.stages``): each device holds ``Psi / P`` (its stage's
    layers; the embedding and head are counted as spread too), ZeRO-sharded over the
    ``N / (R T P)`` devices of its stage; a stage runs ``L / P`` layers and keeps the
    activations of the micro-batches its schedule's table has in flight; each micro-batch's
    activations go forward to the next stage and their gradient back."""
    expert: int = 1
    """The expert axis E_p (``expert_parallel.autoep_size``; the mesh ``{data: N/E_p, expert:
    E_p}``): it divides ``devices`` (per replica group) and the model's ``experts``; the
    experts stay whole over ``model``."""
    micro_batches: int | None = None
    """The micro-batches M a step (``gradient_accumulation_steps``); ``None``: 2P (the
    estimate's default)."""
    schedule: str = "1f1b"
    """The pipeline's schedule: ``"1f1b"``, ``"gpipe"``, ``"interleaved_1f1b"`` or
    ``"zero_bubble"``: a stage keeps the activations of the most micro-batches its table has
    in flight (``M`` under GPipe, ``P`` under 1F1B and zero-bubble, a chunk's ``1 / V`` each
    under interleaving), and idles for its bubble."""
    virtual: int | None = None
    """``V``, the chunks of layers per stage under ``interleaved_1f1b`` (``None``: 2 there,
    else 1)."""

    @property
    def data(self) -> int:
        """The ``data`` axis: the devices the other axes leave."""
        return self.devices // math.prod(self.size(a) for a in AXES if a != "data")

    @property
    def batch_split(self) -> int:
        """The data-parallel degree, the devices a step's rows are split over: ``replica`` x
        ``data`` x ``expert``."""
        return self.replica * self.data * self.expert

    @property
    def shards(self) -> int:
        """ZeRO's group, the devices each sharded state is split over: ``data`` x ``context``
        x ``seq`` x ``expert``, ``N / (R T P)``."""
        return self.devices // self.replica // self.model // self.pipe

    def size(self, axis: str) -> int:
        """The size of the mesh axis named ``axis`` (one of :data:`AXES`)."""
        return self.data if axis == "data" else getattr(self, axis)

    @property
    def name(self) -> str:
        """``data 4 x model 2``: the axes larger than 1 (``data`` always), and the
        micro-batches where more than one."""
        parts = [f"{a} {self.size(a)}" for a in AXES if self.size(a) > 1 or a == "data"]
        text = " x ".join(parts)
        m = self.micro_batches or 1
        return text + (f", {m} micro" if m > 1 else "")


@dataclass(frozen=True)
class Dtypes:
    """The dtypes the activations and the optimizer state are counted in."""

    activations: str = "bf16"
    """``"bf16"`` (as the mixed-precision model states), ``"fp16"`` or ``"fp32"``."""
    optimizer: str = "fp32"
    """The optimizer state's dtype at rest: ``"fp32"`` (the ZeRO paper's K = 12, fp32 master
    4 + moments 4 + 4) or ``"bf16"`` (alias ``"bfloat16"``; jzero's ``bf16: {enabled: true,
    bf16_optimizer_states: true}``: Adam's moments in bfloat16, the masters fp32, K = 4 + 2 + 2
    = 8). K is the optimizer-state part of every stage's formula (stage 1 ``4 Psi + K Psi/N``),
    of the offloaded host rows and of the NVMe tier; nothing else changes."""
    master: str = "fp32"
    """The master weights' dtype: ``"fp32"`` (a 4-byte copy in K) or ``"bf16"`` (alias
    ``"bfloat16"``; ``bf16.bf16_master_weights_and_grads``: the bf16 params are the masters, K
    drops by 4, to 8, or to 4 with ``optimizer="bf16"``)."""
