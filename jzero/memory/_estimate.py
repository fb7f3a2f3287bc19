"""The closed-form estimate: ZeRO's per-device model-state memory for any model and device count.

Decisions:

* Every byte and traffic term comes from the stage table's flags
  (:mod:`jzero.choices.stages`): a stage's row lists the offload options it allows; device
  memory without offload is the ZeRO paper's, mixed-precision Adam with K = 12
  (:meth:`~jzero.choices.stages.StageSpec.model_state_bytes`, the formulas printed by
  :func:`~jzero.choices.stages.formula_text`); the communication per step is
  :meth:`~jzero.choices.stages.StageSpec.traffic`.
* Offload and host memory follow DeepSpeed's estimators (:func:`jzero.costs.model_states`;
  ``additional_buffer_factor`` 1.5, host memory per node), where LL is the largest layer's
  parameter count: a stage that shards the parameters also holds that layer gathered (4 bytes
  a parameter: its 16-bit params and grads), and its host holds only that layer while loading
  (parameters are created in their shards, DeepSpeed's ``zero_init``).
* Activations, only when the transformer's shape is given (sequence length s, micro batch per
  device b, hidden size h, layers L, attention heads a): Korthikanti et al. 2022, "Reducing
  Activation Recomputation in Large Transformer Models" (arXiv:2205.05198), section 4, without
  tensor or sequence parallelism. Per layer, without recomputation, ``s b h (34 + 5 a s / h)``
  bytes, which assumes 16-bit activations (2 bytes an element) and 1-byte dropout masks:
  ``32 s b h + 4 a s^2 b`` of 16-bit values and ``2 s b h + a s^2 b`` of masks. For fp32
  activations jzero doubles the 16-bit part and keeps the masks at 1 byte: per layer
  ``s b h (32 k + 2) + a s^2 b (4 k + 1)``, k = bytes per element / 2 (1 for bf16/fp16, 2 for
  fp32). With full recomputation (activation checkpointing) only each layer's input is kept,
  ``2 k s b h`` bytes per layer (the paper's ``2 s b h L``), and jzero adds the one layer whose
  activations are rebuilt in the backward pass: ``2 k s b h L + per layer``. Embeddings, the
  final LayerNorm and the logits are not counted. ZeRO does not shard activations: every
  stage and offload option carries the same term.
* The model's :class:`~jzero.costs.Techniques` (blockwise attention, dropout, tiled loss and
  MLP, activation offload), its vocabulary (the float32 logits) and the layout's ``context``
  axis (ring attention: the tokens split by C) change the activation term
  (:func:`jzero.costs.activation_bytes`); the default, :data:`jzero.costs.PAPER` without a
  vocabulary, is the paper's accounting above. :meth:`Estimate.sequence_report` adds the
  techniques one a row and finds the longest sequence that fits
  (:mod:`jzero.memory._sequence`).
* Without the transformer's shape, activations are not counted and the margin of the
  recommendation is kept for them.
* The NVMe tier (``offload_optimizer: {device: nvme}``, rows ``nvme``, offered last, as the
  seed documents advise: offload to host memory first): device memory as with the optimizer
  offloaded; host memory only the groups in flight (``buffer_count`` 4 x one group of a
  device's state, ``min(sub_group_size, Psi / N)`` elements x 12 bytes (masters and moments),
  x 1.5, per device of a node; DeepSpeed's default ``sub_group_size`` of 1e9 makes a group a
  whole shard of most models: set it lower for the NVMe tier); disk per node the masters and
  moments twice (``2 x 12 Psi / nodes``: the step writes the new version beside the old).
* Hybrid sharding (``replica`` R > 1, DeepSpeed's MiCS, FSDP's HSDP): each of the R replica
  groups holds the whole model state sharded over its ``D = N / R`` devices, so the sharded
  terms divide by D (host memory per node likewise, the replica group's ``D / devices per node``
  nodes sharing it). The cross-host column is the communication that crosses nodes per step:
  with replicas, only the gradient shards (:meth:`~jzero.choices.stages.StageSpec.replica_traffic`,
  ``2 Psi / D``; all of stage 0's all-reduce); without, on several nodes, all of the stage's
  traffic; on one node, none.
* Experts (mixture of experts, ``experts`` E per MoE layer, the layout's ``expert`` E_p,
  ``expert_params`` Psi_e of the ``params``, DeepSpeed-MoE's expert parallelism; jzero's
  ``expert_parallel: {autoep_size: E_p}``, mesh ``{data: N/E_p, expert: E_p}``): the expert and
  the dense parameters are counted apart, because ZeRO shards them over different groups. Each
  expert parameter rests split over ``expert`` (a device holds E/E_p of the experts, Psi_e/E_p
  parameters) and ZeRO shards it further only over ``data``, its N/E_p devices (DeepSpeed's
  *expert data-parallel group*); the dense parameters Psi_d = Psi - Psi_e are ZeRO-sharded over
  all N devices as without experts. So each stage's formula holds twice: for Psi_d over N, and
  for Psi_e/E_p over N/E_p (stage 0 16 Psi_e/E_p, stage 1 4 Psi_e/E_p + 12 Psi_e/N, stage 2
  2 Psi_e/E_p + 14 Psi_e/N, stage 3 16 Psi_e/N: E_p x N/E_p = N), offload and host memory
  likewise (a node holds its devices' expert shards: at stage 3 16 Psi_e/nodes x 1.5). The
  experts' states are the device categories named ``expert ...``; the largest layer gathered
  at stage 3 is counted with the dense part. With E_p = 1 the experts are plain parameters
  sharded over all N, and the totals are those of Psi without experts. DeepSpeed's own
  estimators have no expert term (they count every parameter as dense, which overstates
  stage 0-2's model states when E_p > 1). Beside tensor parallelism the experts stay whole on
  each device of the ``model`` axis (AutoTP splits the dense layers only), so the dense part
  is Psi_d / (T P) a device and the experts' Psi_e / (E_p P); beside sequence parallelism N
  counts the ``seq`` devices too; beside a pipeline each stage holds its layers' experts.
  Expert parallelism does not compose with the NVMe tier in jzero yet (the config refuses it),
  so the estimate lists no NVMe rows with E_p > 1. The tokens' all-to-alls and the MoE
  layers' dispatch buffers are not counted.
* 16-bit optimizer state (``Dtypes(optimizer="bf16")``, jzero's ``bf16: {enabled: true,
  bf16_optimizer_states: true}``, :mod:`jzero.optim.low_precision`): Adam's two moments rest
  in bfloat16 (2 bytes each instead of 4) while the master weights stay fp32, so K = 4 + 2 + 2
  = 8 instead of 12. K replaces 12 wherever the optimizer state is counted: every stage's
  device formula (stage 0 12 Psi, stage 1 4 Psi + 8 Psi/N, stage 2 2 Psi + 10 Psi/N, stage 3
  12 Psi/N), the offloaded host rows (DeepSpeed's 16 = fp32 gradients 4 + K, 18 = 16-bit
  params 2 + 4 + K, ``max(4 N, 16)`` = ``max(4 N, 4 + K)``: 12, 14, ``max(4 N, 12)``) and the
  NVMe tier's buffers and disk (K bytes of masters and moments). The params, the gradients,
  the fp32 model the host holds while loading and the activations are unchanged.
* 16-bit master weights (``Dtypes(master="bf16")``, jzero's ``bf16: {enabled: true,
  bf16_master_weights_and_grads: true}``, :mod:`jzero.optim.master16`): the bfloat16 params
  are the masters, so the fp32 copy's 4 bytes leave K: K = 8 (fp32 moments) or, with
  ``optimizer="bf16"`` as well, K = 4, DeepSpeed 0.19's 2 + 2 + 4 = 8 bytes a parameter
  at stage 0 (stage 1 4 Psi + 4 Psi/N, stage 2 2 Psi + 6 Psi/N, stage 3 8 Psi/N). The
  offloaded host rows take the same K; there are no NVMe rows (jzero's config refuses the
  NVMe tier with bf16 masters); the params and gradients are unchanged (16-bit already).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from jzero import costs
from jzero._util import divisors
from jzero.choices import stages
from jzero.choices.pipeline import SCHEDULES
from jzero.choices.pipeline import virtual_stages as virtual_stages_of
from jzero.choices.stages import OFFLOADS, StageSpec, formula_text
from jzero.costs import (
    ATTENTIONS,
    DTYPE_BYTES,
    OPTIMIZER_DTYPES,
    PAPER,
    Dtypes,
    ModelShape,
    ParallelDims,
    Techniques,
)
from jzero.memory._format import (
    GIB,
    Recommendation,
    check_margin,
    check_positive,
    find_row,
    parse_size,
    recommend,
    recommended_index,
    render_columns,
)
from jzero.memory._plot import plot_bars
from jzero.memory._sequence import SequenceReport, sequence_report

if TYPE_CHECKING:
    from jzero.choices.schedules import Schedule

__all__ = ["Estimate", "EstimateRow", "Offload", "estimate"]

Offload = Literal["none", "cpu"]
_SHAPE = ("seq_len", "micro_batch", "hidden", "layers", "heads")
_EXPERT = "expert "
"""The prefix of an :class:`EstimateRow`'s device categories that hold the experts' model
states (``expert params``, ``expert grads``, ``expert optimizer state``)."""
_COUNT_SUFFIX = {"k": 1e3, "m": 1e6, "b": 1e9, "t": 1e12}


def _count(value: object, what: str, example: str) -> float:
    """A positive parameter count: a number, or a string such as ``7.5e9``, ``7.5B``,
    ``350M`` (suffixes K, M, B, T: powers of 1000, any case); else the error of
    :func:`check_positive`."""
    if isinstance(value, str):
        m = re.fullmatch(r"\s*([0-9.eE+-]+)\s*([kKmMbBtT])\s*", value)
        if m:
            try:
                return check_positive(
                    float(m.group(1)) * _COUNT_SUFFIX[m.group(2).lower()], what, ""
                )
            except ValueError:
                pass
    return check_positive(value, what, example)


@dataclass(frozen=True)
class EstimateRow:
    """One option of :func:`estimate`: a stage with or without offload.

    Attributes:
      stage: the ZeRO stage.
      offload: ``"none"``, ``"optimizer"`` or ``"optimizer+params"``.
      device: bytes per device by category; with experts, the experts' model states are the
        categories named ``expert ...`` (summed by :attr:`expert_bytes`), the
        others the dense parameters' and the gathered layer (:attr:`dense_bytes`).
      host: bytes of host memory per node by category (experts and dense together).
      comm_psi: communication volume per step in units of Psi (elements).
      comm: the collectives behind ``comm_psi``.
      activations: activation bytes per device without recomputation (0: not counted).
      activations_checkpointed: the same with full activation checkpointing (the device's
        part; :attr:`activations_host` the host's).
    """

    stage: int
    offload: str
    device: Mapping[str, float]
    host: Mapping[str, float]
    comm_psi: float
    comm: str
    activations: float = 0.0
    activations_checkpointed: float = 0.0
    cross_host_psi: float = 0.0
    disk: float = 0.0
    model_axis_bytes: float = 0.0
    seq_axis_bytes: float = 0.0
    pipe_axis_bytes: float = 0.0
    activations_host: float = 0.0
    """Activation bytes a device keeps in host memory with activation checkpointing: the
    offloaded layer inputs (``Techniques(offload=True)``), else 0."""
    context_axis_bytes: float = 0.0
    """Bytes a device sends a step on the ``context`` axis (ring attention's keys and values,
    :func:`jzero.costs.context_axis_bytes`); 0 without it or without the shape."""
    deepspeed: tuple[int, int] | None = None
    """DeepSpeed's own estimators' ``(device, host per node)`` bytes of this option
    (:func:`jzero.costs.deepspeed_model_states`), or None where it has none (stage 0, nvme)."""

    @property
    def device_bytes(self) -> float:
        """Model-state bytes per device (activations apart)."""
        return sum(self.device.values())

    @property
    def expert_bytes(self) -> float:
        """Model-state bytes per device of the expert parameters (Psi_e/E_p, sharded over the
        N/E_p devices of the expert data-parallel group); 0 without experts."""
        return sum(v for k, v in self.device.items() if k.startswith(_EXPERT))

    @property
    def dense_bytes(self) -> float:
        """Model-state bytes per device of the dense parameters (Psi_d sharded over N), with
        the largest layer gathered at stage 3: :attr:`device_bytes` less
        :attr:`expert_bytes`."""
        return sum(v for k, v in self.device.items() if not k.startswith(_EXPERT))

    def total_bytes(self, checkpointing: bool = False) -> float:
        """Bytes per device: model states + activations, with or without checkpointing."""
        act = self.activations_checkpointed if checkpointing else self.activations
        return self.device_bytes + act

    @property
    def host_bytes(self) -> float:
        """Bytes of host memory per node."""
        return sum(self.host.values())


@dataclass(frozen=True)
class Estimate:
    """The result of :func:`estimate`; ``table()`` prints it, ``plot(path)`` draws it.

    ``experts`` (E), ``layout.expert`` (E_p) and ``expert_params`` (Psi_e, part of
    ``params``) are 0, 1 and 0 without experts; ``optimizer_dtype`` is ``"fp32"`` (K = 12)
    or ``"bf16"`` (K = 8, :attr:`optimizer_bytes`); ``master_dtype`` ``"bf16"`` takes the
    fp32 master's 4 bytes out of K (8 or 4)."""

    params: float
    layout: ParallelDims
    """The devices' layout, its sizes resolved (``devices_per_node``, ``micro_batches`` and
    ``virtual`` set)."""
    rows: tuple[EstimateRow, ...]
    device_memory: int | None = None
    margin: float = 0.1
    largest_layer_params: float = 0
    additional_buffer_factor: float = costs.BUFFER_FACTOR
    shape: Mapping[str, int] | None = None
    activation_dtype: str = "bf16"
    experts: int = 0
    expert_params: float = 0
    optimizer_dtype: str = "fp32"
    master_dtype: str = "fp32"
    vocab: int | None = None
    """The vocabulary V whose logits are counted; ``None``: not counted."""
    techniques: Techniques = PAPER
    """How the layers keep their activations (:class:`jzero.costs.Techniques`)."""
    deepspeed_layer_params: float = 0
    """The largest layer DeepSpeed's figures use (its largest module's own parameters, the
    model's ``largest_module_params``; else ``largest_layer_params``)."""

    @property
    def devices(self) -> int:
        """The devices N."""
        return self.layout.devices

    @property
    def devices_per_node(self) -> int:
        """Devices per node."""
        return int(self.layout.devices_per_node or 1)

    @functools.cached_property
    def pipeline_table(self) -> Schedule | None:
        """The pipeline schedule's table (its bubble, what a stage keeps in flight), or None
        without a pipeline."""
        if self.layout.pipe <= 1:
            return None
        from jzero.choices.schedules import make_schedule  # NumPy: only with a pipeline

        return make_schedule(
            self.layout.schedule, self.layout.pipe, self.layout.micro_batches, self.layout.virtual
        )

    @property
    def optimizer_bytes(self) -> int:
        """K, the optimizer state's bytes per parameter: 12 (fp32 master and moments), 8 with
        ``optimizer_dtype="bf16"`` (fp32 master, bf16 moments); 4 fewer with
        ``master_dtype="bf16"`` (no fp32 master: 8, or 4 with bf16 moments)."""
        return costs.optimizer_bytes(self.optimizer_dtype, self.master_dtype)

    @property
    def shards(self) -> int:
        """Devices each sharded state is split over: ``devices / (replicas x T x P)``."""
        return self.layout.shards

    @property
    def expert_shards(self) -> int:
        """Devices each expert parameter's state is sharded over, its expert data-parallel
        group: ``shards / E_p``."""
        return self.shards // self.layout.expert

    @property
    def counts_activations(self) -> bool:
        """Whether the transformer's shape was given, so activations are counted."""
        return self.shape is not None

    @property
    def recommendation(self) -> Recommendation | None:
        """The cheapest option that fits: lowest stage, then activation checkpointing (when
        activations are counted), then offload; ``None`` without a memory size."""
        options = []
        for r in self.rows:
            if not self.counts_activations:
                options.append((r.stage, r.offload, None, r.device_bytes))
                continue
            options.append((r.stage, r.offload, "none", r.total_bytes(False)))
            options.append((r.stage, r.offload, "full", r.total_bytes(True)))
        return recommend(options, self.device_memory, self.margin, ("GiB", GIB))

    def row(self, stage: int, offload: str = "none") -> EstimateRow:
        """The row of one option."""
        return find_row(self.rows, stage, offload)

    def sequence_report(self, stage: int = 3) -> SequenceReport:
        """The long-sequence table of this model and layout: activations per device with each
        long-context technique added in turn and, with a device memory, the longest sequence
        that fits beside the model states of ``stage`` without offload
        (:func:`~jzero.memory.sequence_report`).

        Raises:
          ValueError: without the transformer's shape, a ``stage`` not 0-3, or an estimate
            of the options with offload only.
        """
        if self.shape is None:
            raise ValueError(
                "The long-sequence table needs the transformer's shape; pass all of "
                f"{', '.join(_SHAPE)} (e.g. 2048, 1, 4096, 32, 32)."
            )
        if stage not in stages.STAGES:
            raise ValueError(
                f"stage: {stage!r} is not allowed; it must be one of "
                f"{', '.join(map(str, stages.STAGES))}."
            )
        sh = self.shape
        model = ModelShape(
            self.params, seq_len=sh["seq_len"], hidden=sh["hidden"], layers=sh["layers"],
            heads=sh["heads"], vocab=self.vocab, techniques=self.techniques,
        )  # fmt: skip
        table = self.pipeline_table
        held = table.slots / self.layout.virtual if table is not None else 1.0
        usable = None if self.device_memory is None else self.device_memory * (1 - self.margin)
        states = [r.device_bytes for r in self.rows if (r.stage, r.offload) == (stage, "none")]
        if not states:
            raise ValueError(
                f"The long-sequence table adds the model states of stage {stage} without "
                "offload, but this estimate lists only the options with offload (offload="
                "'cpu'); estimate with offload=None or 'none'."
            )
        return sequence_report(
            model, self.layout, states=states[0], stage=stage, usable=usable,
            dtype=self.activation_dtype, in_flight=held,
        )  # fmt: skip

    def table(self) -> str:
        """The estimate as text: one row per option, the conventions, the recommendation."""
        nodes = self.devices // self.devices_per_node
        usable = None if self.device_memory is None else self.device_memory * (1 - self.margin)
        act = self.counts_activations
        moe = self.experts > 0
        k = self.optimizer_bytes
        moments = "bf16 moments 2 + 2" if self.optimizer_dtype == "bf16" else "fp32 moments 4 + 4"
        header = ["stage", "offload", "device GiB"] + (["expert GiB", "dense GiB"] if moe else [])
        header += ["act GiB", "act AC GiB", "total GiB", "total AC GiB"] if act else []
        disk = any(r.disk for r in self.rows)
        header += ["host GiB/node"] + (["disk GiB/node"] if disk else []) + ["comm/step"]
        header += ["cross-host/step"]
        split = act and (self.layout.model > 1 or self.layout.seq > 1)
        header += ["model GiB/step", "seq GiB/step"] if split else []
        ringed = act and self.layout.context > 1
        header += ["context GiB/step"] if ringed else []
        piped = act and self.layout.pipe > 1
        header += ["pipe GiB/step"] if piped else []
        header += ["DeepSpeed GB", "DeepSpeed host GB"]
        header += (["fits"] if usable is not None else []) + ["collectives"]
        rows = []
        for r in self.rows:
            cells = [str(r.stage), r.offload, f"{r.device_bytes / GIB:.2f}"]
            if moe:
                cells += [f"{r.expert_bytes / GIB:.2f}", f"{r.dense_bytes / GIB:.2f}"]
            if act:
                cells += [f"{r.activations / GIB:.2f}", f"{r.activations_checkpointed / GIB:.2f}"]
                cells += [f"{r.total_bytes(False) / GIB:.2f}", f"{r.total_bytes(True) / GIB:.2f}"]
            cells += [f"{r.host_bytes / GIB:.2f}"] + ([f"{r.disk / GIB:.2f}"] if disk else [])
            cells += [f"{r.comm_psi:g} Psi"]
            cells.append(f"{r.cross_host_psi:.3g} Psi" if r.cross_host_psi else "0")
            if split:
                cells += [f"{r.model_axis_bytes / GIB:.3g}", f"{r.seq_axis_bytes / GIB:.3g}"]
            if ringed:
                cells.append(f"{r.context_axis_bytes / GIB:.3g}")
            if piped:
                cells.append(f"{r.pipe_axis_bytes / GIB:.3g}")
            ds = r.deepspeed
            cells += [f"{ds[0] / GIB:.2f}", f"{ds[1] / GIB:.2f}"] if ds else ["-", "-"]
            if usable is not None:
                if r.total_bytes(False) <= usable:
                    cells.append("yes")
                else:
                    cells.append("AC" if act and r.total_bytes(True) <= usable else "no")
            rows.append([*cells, r.comm])
        hybrid = (
            f", hybrid: {self.layout.replica} replicas of {self.shards} devices (N in the formulas "
            f"is {self.shards})"
            if self.layout.replica > 1
            else ""
        )
        if self.layout.model > 1 or self.layout.seq > 1:
            hybrid += (
                f", tensor_parallel T = {self.layout.model}, sequence_parallel S = "
                f"{self.layout.seq}: each device holds "
                + (
                    f"Psi_d/T = {(self.params - self.expert_params) / self.layout.model:.4g} "
                    "dense parameters (the experts whole)"
                    if moe
                    else f"Psi/T = {self.params / self.layout.model:.4g} parameters"
                )
                + f", ZeRO-sharded over N = {self.shards} (data x seq)"
            )
        if self.layout.pipe > 1:
            p, m = self.layout.pipe, self.layout.micro_batches
            hybrid += (
                f", pipeline P = {p} stages ({self.layout.schedule}, M = {m} micro-batches, "
                f"bubble from its table {self.pipeline_table.bubble:.3g}): each device holds "
                f"Psi/P of the layers, ZeRO-sharded over its stage's {self.shards} devices"
            )
        if moe:
            e, ep = self.experts, self.layout.expert
            hybrid += (
                f", experts: E = {e} per MoE layer, E_p = {ep} (each device holds {e // ep} of "
                f"them), Psi_e = {self.expert_params:.4g} expert and Psi_d = "
                f"{self.params - self.expert_params:.4g} dense parameters"
            )
        lines = [
            f"ZeRO model states per device: Psi = {self.params:.4g} parameters, "
            f"N = {self.devices} devices ({nodes} node(s) x {self.devices_per_node}){hybrid}; "
            "GiB = 2^30 bytes",
            *render_columns(header, rows, (1, len(header) - 1)),
            (
                f"device: ZeRO paper, mixed-precision Adam (K = 12): {formula_text()}"
                if k == 12
                else f"device: ZeRO paper, mixed-precision Adam with 16-bit optimizer state (K = "
                f"{k}: fp32 master 4 + bf16 moments 2 + 2, bf16.bf16_optimizer_states): "
                f"{formula_text(k)}"
                if self.master_dtype == "fp32"
                else f"device: ZeRO paper's Adam with bf16 master weights (K = {k}: no fp32 "
                f"master, {moments}, bf16.bf16_master_weights_and_grads): {formula_text(k)}"
            ),
            f"  (+ 4 bytes x the largest layer's {self.largest_layer_params:.4g} parameters "
            "at stage 3, gathered at once).",
            "offload and host: DeepSpeed's estimators, additional_buffer_factor "
            f"{self.additional_buffer_factor:g}, host memory per node: offload at stages 1-2 "
            f"2 Psi / Psi x max(4 N, {4 + k}) x 1.5;",
            f"  stage 3 optimizer offload 2 Psi/N + 4 LL / {4 + k} Psi/nodes x 1.5; stage 3 "
            f"optimizer + params 4 LL / {6 + k} Psi/nodes x 1.5; no offload: 4 Psi x devices "
            "per node x 1.5",
            "  while loading (stage 3: the largest layer only)."
            + ("" if act else " Activations are not counted."),
            *(
                [
                    "nvme: device as offloaded optimizer; host 4 buffers of one sub-group a "
                    f"device (min(sub_group_size, Psi/N) x {k} B x 1.5); disk 2 x {k} Psi/nodes."
                ]
                if disk
                else []
            ),
            "DeepSpeed GB: DeepSpeed's own estimators, in its unit (bytes / 2^30, which it "
            "labels GB): estimate_zero2_model_states_mem_needs at stages 1-2, "
            "estimate_zero3_... at stage 3 (zero_init), all N devices, the whole "
            f"Psi, its largest module's {self.deepspeed_layer_params:.4g} parameters:",
            "  stages 1-2 2 Psi + 18 Psi/N (offloaded: 2 Psi), stage 3 4 LL + 18 Psi/N (4 LL + "
            "2 Psi/N with the optimizer offloaded, 4 LL with the params too); host as above with "
            "16 and 18; none at stage 0 or for nvme.",
            *(
                ["No nvme rows: jzero's bf16 master weights do not compose with the NVMe tier yet."]
                if self.master_dtype == "bf16" and any(r.offload != "none" for r in self.rows)
                else []
            ),
        ]
        if moe:
            ep, n_e = self.layout.expert, self.expert_shards
            nvme_note = "\n  No nvme rows: jzero's expert parallelism does not compose with it yet."
            lines += [
                "experts (DeepSpeed's expert data-parallel groups): expert GiB is the experts' "
                f"model states, Psi_e/E_p = {self.expert_params / ep:.4g} parameters a device "
                f"ZeRO-sharded over its expert data-parallel group of N/E_p = {n_e} device(s):",
                "  each formula above with Psi_e/E_p for Psi and N/E_p for N (stage 3: "
                f"{4 + k} Psi_e/N, "
                "as E_p x N/E_p = N); dense GiB is Psi_d's over N, and the gathered layer.",
                "  comm/step counts Psi as the device's Psi_d + Psi_e/E_p (the experts' "
                "collectives within their group); the tokens' all-to-alls are not counted."
                + (nvme_note if ep > 1 and any(r.offload != "none" for r in self.rows) else ""),
            ]
        if act:
            sh, k = self.shape or {}, DTYPE_BYTES[self.activation_dtype] / 2
            paper = self.techniques == PAPER and not self.vocab and self.layout.context == 1
            where = (
                f"activations per device (s = {sh['seq_len']}, b = {sh['micro_batch']}, "
                f"h = {sh['hidden']}, L = {sh['layers']}, a = {sh['heads']}, "
                + (f"V = {self.vocab}, " if self.vocab else "")
                + f"{self.activation_dtype}): "
            )
            if paper:
                lines += [
                    where + "Korthikanti et al. 2022, per layer s b h "
                    "(34 + 5 a s / h) bytes in 16-bit (1-byte dropout masks);",
                    f"  used here: per layer s b h ({32 * k:g} + 2) + a s^2 b ({4 * k:g} + 1) "
                    "(16-bit part x bytes/2, masks 1 byte); with full activation checkpointing "
                    f"(AC) {2 * k:g} s b h L + one layer rebuilt in the backward pass.",
                ]
            else:
                lines.append(
                    where
                    + "Korthikanti et al. 2022's terms with "
                    + self._techniques_text()
                    + "; with full activation checkpointing (AC) each layer's input, one layer "
                    "rebuilt (jzero.costs.activation_bytes)."
                )
            lines.append("  fits: yes (without AC), AC (only with activation checkpointing), no.")
            if ringed:
                lines.append(
                    f"  context GiB/step: ring attention over C = {self.layout.context} passes a "
                    "device's keys and values (2 s b h / (S C T)) C-1 steps forward, and again "
                    "with their gradients backward: 6 (C-1) s b h / (S C T) a layer."
                )
            if split:
                t, sp = self.layout.model, self.layout.seq
                if paper:
                    lines.append(
                        f"  split over T = {t} and S = {sp}: per layer (s b h ({8 * k:g} + 2 + "
                        f"{24 * k:g}/T) + a s^2 b ({4 * k:g} + 1)/T) / S (Korthikanti et al.'s "
                        "tensor-parallel split; Ulysses divides every term by S)."
                    )
                lines.append(
                    "  model GiB/step: Megatron's 4 all-reduces of s b h / S a layer, 2 (T-1)/T "
                    "each; seq GiB/step: Ulysses's 8 all-to-alls of s b h / (S T) a layer, "
                    "(S-1)/S each; comm/step counts Psi as the device's Psi/T."
                )
            if piped:
                held = self.pipeline_table.slots / self.layout.virtual  # a chunk: 1/V
                lines += [
                    f"  pipeline: a stage runs L/P layers and keeps {held:g} micro-batches of "
                    f"their activations ({self.layout.schedule}: the most passes in flight "
                    "in its table); pipe GiB/step: each of the M micro-batches sends its s b h "
                    "activations to the next stage and their gradient back (V times under "
                    "interleaving: each chunk boundary).",
                ]
        if self.recommendation is not None:
            lines.append(str(self.recommendation))
        return "\n".join(lines)

    def _techniques_text(self) -> str:
        """The model's techniques in words, for the table's note."""
        t, c = self.techniques, self.layout.context
        parts = [
            f"{t.attention} attention" + (f" (ring over C = {c}: by blocks)" if c > 1 else ""),
            f"dropout {'on' if t.dropout else 'off'}",
        ]
        if self.vocab:
            parts.append(f"loss chunk {t.loss_chunk}" if t.loss_chunk else "whole logits")
        else:
            parts.append("logits not counted")
        parts.append(f"MLP chunk {t.mlp_chunk}" if t.mlp_chunk else "whole MLP")
        if t.offload:
            host = self.rows[0].activations_host if self.rows else 0.0
            parts.append(
                f"activation offload (AC's layer inputs in host memory, {host / GIB:.2f} GiB a "
                "device)"
            )
        return ", ".join(parts)

    def bars(self) -> list[tuple[str, Mapping[str, float], Mapping[str, float]]]:
        """(label, device bytes by category, host bytes by category) per option, for plots;
        with activations counted, each option without and with activation checkpointing."""
        if not self.counts_activations:
            return [(f"{r.stage}\n{r.offload}", r.device, r.host) for r in self.rows]
        out = []
        for r in self.rows:
            label = f"{r.stage}\n{r.offload}"
            out.append((label, {**r.device, "activations": r.activations}, r.host))
            ac = {**r.device, "activations": r.activations_checkpointed}
            out.append((label + "\n+AC", ac, {}))  # the same host memory, drawn once
        return out

    def plot(self, path: str) -> None:
        """Draws the options as horizontal stacked bars into a PNG, each marked fits or not (and
        its host memory per node) and the recommended one starred."""
        limit = None if self.device_memory is None else self.device_memory * (1 - self.margin)
        title = f"ZeRO estimate: {self.params:.3g} parameters on {self.devices} devices"
        acs = (False, True) if self.counts_activations else (False,)
        options = [(r.stage, r.offload, ac) for r in self.rows for ac in acs]
        pick = recommended_index(options, self.recommendation)
        plot_bars(
            path,
            title,
            self.bars(),
            limit=limit,
            unit=("GiB", GIB),
            recommended=pick,
            host_label="host per node",
        )


def estimate(
    model: ModelShape,
    layout: ParallelDims,
    device_memory: int | str | None = None,
    offload: Offload | None = None,
    *,
    margin: float = 0.1,
    dtypes: Dtypes | None = None,
    sub_group_size: float = 1e9,
    additional_buffer_factor: float = costs.BUFFER_FACTOR,
) -> Estimate:
    """Closed-form per-device memory of ZeRO stages 0-3, with and without offload.

    Model states follow the ZeRO paper and DeepSpeed's estimators (see the module docstring).
    Given a transformer's shape (all of the model's ``seq_len``, ``hidden``, ``layers``,
    ``heads`` and the layout's ``micro_batch``), activations are added per device from
    Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models":
    per layer ``s b h (34 + 5 a s / h)`` bytes in 16-bit without recomputation, ``2 s b h`` per
    layer with full recomputation (plus one layer rebuilt in the backward pass); fp32 doubles
    the 16-bit part (:func:`jzero.costs.transformer_activations`). Each option then has a
    total without and with activation checkpointing, and the recommendation weighs stage,
    then activation checkpointing, then offload.

    Args:
      model: the parameter count, largest layer, transformer shape and experts
        (:class:`jzero.costs.ModelShape`).
      layout: the devices, per node, the mesh's axes, the micro batch and the pipeline's
        micro-batches and schedule (:class:`jzero.costs.ParallelDims`; ``data`` is what the
        other axes leave of the devices N).
      device_memory: the memory of one device (bytes, or a size such as ``"80GB"``); with it
        the result marks what fits and recommends a stage.
      offload: ``None`` lists every option, ``"none"`` only those without offload, ``"cpu"``
        only those with offload to host memory.
      margin: fraction of the device memory kept free (fragmentation, the runtime, and
        activations when the transformer's shape is not given).
      dtypes: the activations', the optimizer state's and the master weights' dtypes
        (:class:`jzero.costs.Dtypes`); ``None``: bf16 activations, fp32 optimizer state and masters.
      sub_group_size: DeepSpeed's ``sub_group_size``, the elements of one group of the
        state the NVMe tier holds in host memory at a time (4 buffers of it).
      additional_buffer_factor: DeepSpeed's slack on host memory.

    Returns:
      An :class:`Estimate`; ``print(result.table())``.

    Example:
      >>> e = estimate(ModelShape(7.5e9), ParallelDims(64))
      >>> round(e.row(0).device_bytes / 1e9, 1), round(e.row(3).device_bytes / 1e9, 3)
      (120.0, 1.875)
      >>> moe = estimate(ModelShape("1B", experts=8, expert_params="0.75B"),
      ...                ParallelDims(8, expert=4))
      >>> [moe.row(1).expert_bytes / 1e9, moe.row(1).dense_bytes / 1e9]  # 4x0.1875 + 12x0.75/8
      [1.875, 1.375]
      >>> one_b, eight = ModelShape(1e9), ParallelDims(8)
      >>> estimate(one_b, eight, dtypes=Dtypes(optimizer="bf16")).row(1).device_bytes / 1e9
      5.0
      >>> sixteen_bit = Dtypes(optimizer="bf16", master="bf16")  # 2 + 2 + 4 bytes at stage 0
      >>> estimate(one_b, eight, dtypes=sixteen_bit).row(0).device_bytes / 1e9
      8.0
    """
    params, largest_layer_params = model.params, model.largest_layer_params
    seq_len, hidden, layers, heads = model.seq_len, model.hidden, model.layers, model.heads
    experts, expert_params = model.experts, model.expert_params
    devices, devices_per_node, replicas = layout.devices, layout.devices_per_node, layout.replica
    micro_batch, tensor_parallel = layout.micro_batch, layout.model
    sequence_parallel, pipeline = layout.seq, layout.pipe
    micro_batches, pipeline_schedule = layout.micro_batches, layout.schedule
    virtual_stages, expert_parallel = layout.virtual, layout.expert
    dtypes = dtypes if dtypes is not None else Dtypes()
    activation_dtype, optimizer_dtype = dtypes.activations, dtypes.optimizer
    master_dtype = dtypes.master
    psi = _count(params, "params", "7.5e9")
    n = check_positive(devices, "devices", "64", integer=True)
    if devices_per_node is None:
        per_node = math.gcd(n, 8)
    else:
        per_node = check_positive(devices_per_node, "devices_per_node", "8", integer=True)
        if n % per_node:
            raise ValueError(
                f"devices_per_node: {per_node} does not divide devices={n}, but the devices must "
                f"fill whole nodes. Pass a devices_per_node that divides {n}, e.g. "
                f"{math.gcd(n, per_node)}."
            )
    r = check_positive(replicas, "replicas", "2", integer=True)
    if n % r:
        raise ValueError(
            f"replicas: {r} does not divide devices={n}; each replica group must have the same "
            f"number of devices. Pass a replicas that divides {n}, e.g. {math.gcd(n, r)}."
        )
    if offload not in (None, "none", "cpu"):
        raise ValueError(
            f"offload: {offload!r} is not allowed; it must be 'cpu' (only options with offload "
            "to host memory), 'none' (only options without) or None (all options)."
        )
    try:
        ll = float(largest_layer_params)
    except (TypeError, ValueError):
        ll = math.nan
    if not 0 <= ll <= psi:
        raise ValueError(
            f"largest_layer_params: {largest_layer_params!r} is not allowed; it must be between "
            f"0 and the parameter count {psi:.4g}."
        )
    tp = check_positive(tensor_parallel, "tensor_parallel", "2", integer=True)
    sp = check_positive(sequence_parallel, "sequence_parallel", "4", integer=True)
    cp = check_positive(layout.context, "context_parallel", "4", integer=True)
    pp = check_positive(pipeline, "pipeline", "2", integer=True)
    mb = 2 * pp if micro_batches is None else check_positive(micro_batches, "micro_batches", "8",
                                                        integer=True)  # fmt: skip
    if pp > 1 and mb < pp:
        raise ValueError(
            f"micro_batches: {mb} is fewer than the {pp} pipeline stages, which need at least "
            f"{pp} to fill; pass micro_batches of {pp} or more (e.g. {2 * pp})."
        )
    if pipeline_schedule not in SCHEDULES:
        raise ValueError(
            f"pipeline_schedule: {pipeline_schedule!r} is not allowed; it must be one of "
            f"{', '.join(SCHEDULES)}."
        )
    virtual_stages = virtual_stages_of(pipeline_schedule, virtual_stages)
    # The schedule's table (it checks the micro-batches' groups and the chunks): what a stage
    # keeps in flight.
    table = None
    if pp > 1:
        from jzero.choices.schedules import make_schedule  # NumPy: only with a pipeline

        table = make_schedule(pipeline_schedule, pp, mb, virtual_stages)
    if n % (r * tp * sp * cp * pp):
        ring = f"context_parallel={cp} x " if cp > 1 else ""
        raise ValueError(
            f"devices={n} can't be split into {r} replica group(s) x tensor_parallel={tp} x "
            f"sequence_parallel={sp} x {ring}pipeline={pp}; pass sizes whose product divides "
            f"{n}."
        )
    if (  # beside other axes (alone, _check_experts names the divisors)
        tp * sp * cp * pp > 1
        and isinstance(expert_parallel, int)
        and expert_parallel > 1
        and n % (r * tp * sp * cp * pp * expert_parallel)
    ):
        raise ValueError(
            f"devices={n} can't be split into {r} replica group(s) x tensor_parallel={tp} x "
            f"sequence_parallel={sp} x pipeline={pp} x expert_parallel={expert_parallel}; pass "
            f"sizes whose product divides {n}."
        )
    if optimizer_dtype not in OPTIMIZER_DTYPES:
        raise ValueError(
            f"optimizer_dtype: {optimizer_dtype!r} is not allowed; it must be one of "
            f"{', '.join(map(repr, OPTIMIZER_DTYPES))}. Pass 'fp32' (the default, K = 12 bytes "
            "of optimizer state a parameter) or 'bf16' for bf16.bf16_optimizer_states (K = 8)."
        )
    opt_dtype = OPTIMIZER_DTYPES[optimizer_dtype]
    if master_dtype not in OPTIMIZER_DTYPES:
        raise ValueError(
            f"master_dtype: {master_dtype!r} is not allowed; it must be one of "
            f"{', '.join(map(repr, OPTIMIZER_DTYPES))}. Pass 'fp32' (the default, a 4-byte fp32 "
            "master copy in K) or 'bf16' for bf16.bf16_master_weights_and_grads (no copy: K "
            "drops by 4)."
        )
    master = OPTIMIZER_DTYPES[master_dtype]
    k = costs.optimizer_bytes(opt_dtype, master)
    n_experts, ep, psi_e = _check_experts(experts, expert_parallel, expert_params, psi, n, r)
    memory = None if device_memory is None else parse_size(device_memory)
    given = {"seq_len": seq_len, "micro_batch": micro_batch, "hidden": hidden}
    given.update(layers=layers, heads=heads)
    shape, act, act_ac, act_host = None, 0.0, 0.0, 0.0
    vocab, techniques = _check_techniques(model)
    if any(v is not None for v in given.values()):
        missing = [k for k, v in given.items() if v is None]
        if missing:
            raise ValueError(
                "The activation term needs the transformer's whole shape, but "
                f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} missing; pass all "
                f"of {', '.join(_SHAPE)} "
                "(e.g. 2048, 1, 4096, 32, 32) or none of them."
            )
        shape = {
            k: check_positive(v, k, ex, integer=True)
            for (k, v), ex in zip(given.items(), ("2048", "1", "4096", "32", "32"), strict=True)
        }
        if activation_dtype not in DTYPE_BYTES:
            raise ValueError(
                f"activation_dtype: {activation_dtype!r} is not allowed; it must be one of "
                f"{', '.join(DTYPE_BYTES)}."
            )
        if pp > 1 and shape["layers"] % pp:
            raise ValueError(
                f"pipeline: {pp} stages do not divide layers={shape['layers']}; pass a number "
                f"of stages among the divisors of {shape['layers']}."
            )
        held = table.slots / virtual_stages if pp > 1 else 1.0  # a chunk: 1/V of the layers
        sized = dataclasses.replace(
            model, seq_len=shape["seq_len"], hidden=shape["hidden"], layers=shape["layers"],
            heads=shape["heads"], vocab=vocab, techniques=techniques,
        )  # fmt: skip
        split = ParallelDims(n, micro_batch=shape["micro_batch"], model=tp, seq=sp, pipe=pp,
                             context=cp)  # fmt: skip
        act, act_ac, act_host = _activations(sized, split, activation_dtype, held)
    model_bytes = seq_bytes = pipe_bytes = context_bytes = 0.0
    if shape is not None:  # the model and seq axes' for one micro-batch through all L layers
        sbh = shape["seq_len"] * shape["micro_batch"] * shape["hidden"] / (sp * cp)
        flow = costs.LayerFlow(sbh, shape["layers"], 1, DTYPE_BYTES[activation_dtype])
        model_bytes = costs.model_axis_bytes(flow, tp)
        seq_bytes = costs.seq_axis_bytes(flow, tp, sp)
        context_bytes = costs.context_axis_bytes(flow, tp, cp)
        if pp > 1:  # each of the M micro-batches forward to the next stage, its gradient back
            flow = dataclasses.replace(flow, micro_batches=mb)
            pipe_bytes = costs.pipe_axis_bytes(flow, virtual_stages)
    # Each device holds Psi / (T P) of the dense model and Psi_e / P of the experts (AutoTP
    # leaves them whole over `model`); ZeRO shards it over its data (x seq x expert) group.
    psi_all, psi, ll = psi, (psi - psi_e) / tp / pp + psi_e / pp, ll / tp
    pe = psi_e / pp  # the experts' share of a device's parameters
    shards = n // r // tp // pp
    buf, nodes = float(additional_buffer_factor), max(1, shards // per_node)
    hosts = costs.Hosts(nodes, per_node, buf)

    def states(spec: StageSpec, option: str) -> tuple[dict[str, float], dict[str, float]]:
        """The model states of the dense Psi - Psi_e over the shards and of the device's
        Psi_e / E_p over the shards / E_p of its expert data-parallel group (the gathered
        layer with the dense part); without experts, of Psi."""
        if not pe:
            return costs.model_states(spec, option, psi, shards, ll, hosts, k)
        device, host = costs.model_states(spec, option, psi - pe, shards, ll, hosts, k)
        e_hosts = costs.Hosts(nodes / ep, per_node, buf)
        e_device, e_host = costs.model_states(spec, option, pe / ep, shards // ep, 0.0, e_hosts, k)
        device.update({_EXPERT + k: v for k, v in e_device.items()})
        return device, {k: host.get(k, 0.0) + e_host.get(k, 0.0) for k in {**host, **e_host}}

    # DeepSpeed's estimators know neither experts nor model axes: all N devices, the whole
    # Psi, its largest module's parameters.
    ds_layer = ll * tp if model.largest_module_params is None else model.largest_module_params
    rows = []
    for option in OFFLOADS:  # the table's rows, without offload first (the printed order)
        if offload == ("cpu" if option == "none" else "none"):  # the rows not asked for
            continue
        for spec in stages.STAGES.values():
            if option in spec.offloads:
                device, host = states(spec, option)
                rows.append((spec, option, device, host, 0.0))
    # The NVMe tier, last (not beside expert parallelism, nor with bf16 masters: jzero's config
    # refuses both).
    if offload != "none" and ep == 1 and master == "fp32":
        for spec in stages.STAGES.values():
            if "optimizer" in spec.offloads:
                device, _ = states(spec, "optimizer")
                group = min(float(sub_group_size), psi / shards)
                host = {"nvme buffers": 4 * group * k * buf * per_node}
                rows.append((spec, "nvme", device, host, 2 * k * psi / nodes))
    out = tuple(
        EstimateRow(
            spec.stage,
            o,
            {k: v for k, v in d.items() if v},
            {k: v for k, v in h.items() if v},
            *spec.traffic(),
            act,
            act_ac,
            costs.cross_host_elements(spec, r, shards, n // per_node),
            disk,
            model_bytes,
            seq_bytes,
            pipe_bytes,
            act_host,
            context_bytes,
            costs.deepspeed_model_states(
                spec, o, psi_all, ds_layer, per_node, max(1, n // per_node), buf
            ),
        )
        for spec, o, d, h, disk in rows
    )
    resolved = dataclasses.replace(
        layout, devices=n, devices_per_node=per_node, replica=r, model=tp, seq=sp, pipe=pp,
        context=cp, expert=ep, micro_batches=mb, virtual=virtual_stages,
        micro_batch=shape["micro_batch"] if shape else None,
    )  # fmt: skip
    return Estimate(
        psi_all, resolved, out, memory, check_margin(margin), ll * tp, buf, shape,
        activation_dtype, n_experts, psi_e, opt_dtype, master, vocab, techniques, ds_layer,
    )  # fmt: skip


def _check_experts(
    experts: object, expert_parallel: object, expert_params: object, psi: float, n: int, r: int
) -> tuple[int, int, float]:
    """``(E, E_p, Psi_e)`` checked against each other, the parameter count Psi and the
    ``n / r`` devices of a replica group; a clear error naming the value and the fix."""
    try:
        e = float(experts) if not isinstance(experts, bool) else math.nan
    except (TypeError, ValueError):
        e = math.nan
    if not (math.isfinite(e) and e >= 0 and e == int(e)):
        raise ValueError(
            f"experts: {experts!r} is not allowed; it must be the whole number of experts of "
            "each MoE layer, e.g. 8, or 0 (no mixture of experts)."
        )
    e = int(e)
    ep = check_positive(expert_parallel, "expert_parallel", "4", integer=True)
    try:
        none = not isinstance(expert_params, bool) and float(expert_params) == 0
    except (TypeError, ValueError):
        none = False
    psi_e = 0.0 if none else _count(expert_params, "expert_params", "6e9")
    if psi_e > psi:
        raise ValueError(
            f"expert_params: {psi_e:.4g} is more than params={psi:.4g}; the experts' parameters "
            f"are part of params (the whole model's count). Pass an expert_params of at most "
            f"{psi:.4g}, or a params that includes the experts."
        )
    if e and not psi_e:
        raise ValueError(
            f"experts: {e} needs expert_params, the parameters of all {e} experts of every MoE "
            "layer together (part of params), e.g. expert_params=6e9; they are sharded apart "
            "from the dense parameters."
        )
    if psi_e and not e:
        raise ValueError(
            f"expert_params: {psi_e:.4g} needs experts, the number of experts of each MoE "
            "layer, e.g. experts=8; pass experts, or expert_params=0 (no mixture of experts)."
        )
    if ep > 1 and not e:
        raise ValueError(
            f"expert_parallel: {ep} splits experts over devices, but experts is 0; pass "
            "experts (the experts of each MoE layer, e.g. 8) and expert_params (their "
            "parameters, part of params), or expert_parallel=1."
        )
    group = n // r
    where = f"devices={n}" if r == 1 else f"the {group} devices of each of the {r} replica groups"
    if group % ep:
        raise ValueError(
            f"expert_parallel: {ep} does not divide {where}; the mesh is {{data: N/E_p, expert: "
            f"E_p}}. Pass an expert_parallel among the divisors of {group} "
            f"({', '.join(map(str, divisors(group)))})."
        )
    if e % ep:
        common = [d for d in divisors(e) if group % d == 0]
        raise ValueError(
            f"expert_parallel: {ep} does not divide the {e} experts; each device of the expert "
            f"axis holds an equal share of them. Pass an expert_parallel among the divisors of "
            f"{e} ({', '.join(map(str, divisors(e)))}); of them, {', '.join(map(str, common))} "
            f"also divide {group}."
        )
    return e, ep, psi_e


def _activations(
    model: ModelShape, layout: ParallelDims, dtype: str, held: float
) -> tuple[float, float, float]:
    """A device's activation bytes (without checkpointing, with ``full`` on the device, with
    ``full`` in host memory) when its pipeline stage holds ``held`` micro-batches; with
    activation offload the first is as without offload (nothing is checkpointed to move)."""
    plain = dataclasses.replace(model, techniques=dataclasses.replace(model.techniques,
                                                                      offload=False))  # fmt: skip
    without = costs.activation_bytes(plain, layout, dtype=dtype, in_flight=held)
    full = costs.activation_bytes(model, layout, checkpointing="full", dtype=dtype, in_flight=held)
    return without.device, full.device, full.host


def _check_techniques(model: ModelShape) -> tuple[int | None, Techniques]:
    """The model's vocabulary (``None`` or a positive integer) and its
    :class:`~jzero.costs.Techniques`, checked; a clear error naming the value and the fix."""
    vocab = None if model.vocab is None else check_positive(model.vocab, "vocab", "32000", True)
    t = model.techniques
    if not isinstance(t, Techniques):
        raise ValueError(
            f"techniques: {t!r} is not allowed; it must be a jzero.costs.Techniques, e.g. "
            "Techniques(attention='blockwise', loss_chunk=1024)."
        )
    if t.attention not in ATTENTIONS:
        raise ValueError(
            f"attention: {t.attention!r} is not allowed; it must be one of "
            f"{', '.join(ATTENTIONS)} (plain keeps the [s, s] scores, blockwise none)."
        )
    for name in ("loss_chunk", "mlp_chunk"):
        value = getattr(t, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(
                f"{name}: {value!r} is not allowed; it must be a whole number of tokens, e.g. "
                "1024, or 0 (not tiled)."
            )
    return vocab, t
