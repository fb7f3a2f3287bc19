"""``"auto"`` parallel sizes: the layout (and stage) predicted fastest whose compiled step fits.

``tensor_parallel.autotp_size``, ``sequence_parallel_size``, ``pipeline.stages``,
``expert_parallel.autoep_size`` (and ``gradient_accumulation_steps`` beside a fixed
``train_batch_size``) may be ``"auto"``, with ``zero_optimization.stage: auto`` or a fixed stage.
At the first batch the engine enumerates the layouts the model and the batch allow, ranks them
by a cost model, compiles them in that order (abstract state: nothing is allocated) and keeps the
first whose compiled peak fits the budget, as :mod:`jzero.engine.auto_stage` does for the stage.

Decisions:

* **Candidates** are every layout the model and batch allow: the sizes of the ``"auto"`` axes
  are powers of two dividing the device count (the others stay as written), their product with
  ``data`` is the device count; the heads divide by ``model`` x ``seq``, the sequence length by
  ``seq``, the stacked layers by ``pipe`` (with at least ``pipe`` micro-batches), the experts by
  ``expert``; the global batch's rows divide by the data-like axes (``replica`` x ``data`` x
  ``expert``) times the micro-batches. A batch of fewer rows than devices therefore needs a
  ``seq``, ``model`` or ``pipe`` axis. An axis whose divisor is unknown (no ``num_heads`` in
  the ``model`` or ``tensor_parallel`` section, no layers traced, no experts) stays 1.
* **Placement**: the axes that talk every layer (``model``, ``seq``, ``expert``) are the mesh's
  minor axes (:func:`jzero.make_mesh`'s order), and a candidate is kept only where their product
  divides one process's devices, so each of their groups stays within a host; ``data``,
  ``pipe`` and ``replica`` may cross hosts, and the cost model prices an axis at the inter-host
  bandwidth where its group does.
* **The cost model is analytic, before any compilation.** Lowered programs hold only the
  collectives jzero writes itself (its ``shard_map`` ZeRO step); tensor parallelism's and the
  GSPMD parts' appear only once XLA partitions the program, in compilation, which is the cost
  being avoided. So each candidate's bytes per step on each axis are the closed forms, per device
  and on the wire (ring: ``(n-1)/n``): ZeRO's group (``data`` x ``seq`` x ``expert``) moves
  ``2 Psi/(T P)`` gradient-and-parameter bytes at stages 0-2 and ``3 Psi/(T P)`` at stage 3; per
  layer and micro-batch of ``X`` activation elements per device, ``model`` four all-reduces,
  ``seq`` eight all-to-alls of ``X/T``, ``expert`` four all-to-alls of ``k X``; ``pipe`` an
  activation forward and its gradient back per micro-batch. Time is the bytes over each axis's
  bandwidth (intra- or inter-host), plus a latency per collective, plus the model's FLOPs
  (:func:`jzero.engine.figures.model_flops`, traced) over the devices' FLOP rate, stretched by
  the pipeline bubble (its schedule's table: ``(P-1)/(M+P-1)`` for 1F1B) and by a third for
  activation checkpointing; nothing is assumed to overlap. Rates: ``auto_layout`` in the
  config, else the platform's defaults (:data:`PLATFORM_RATES`). Ties keep the planner's
  order of stages.
* **Measured where it matters**: the prediction only orders the compilations; a candidate is
  kept by its compiled peak (:func:`jzero.engine.figures.compiled_peak_bytes`), the first that
  fits ``device_memory`` (or the accelerator's limit, :func:`jzero.engine.auto_stage.budget`).
  Its jitted step is the engine's step (its first call runs the executable compiled here).
* **Recorded**: the engine's config holds the concrete sizes, stage, micro batch and
  accumulation, so ``describe()``, checkpoints' metadata and ``jzero train``'s summary name them;
  an engine restored from such a checkpoint before its first step compiles that layout only.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from jzero import config as config_lib
from jzero._util import format_bytes
from jzero.distributed.pipeline import make_schedule
from jzero.engine.auto_stage import Candidate as StageCandidate
from jzero.engine.auto_stage import compiled_need
from jzero.plan import stage_spec

__all__ = [
    "PLATFORM_RATES",
    "AutoLayout",
    "Choice",
    "Layout",
    "ModelShape",
    "Prediction",
    "Rates",
    "Row",
    "adopt_saved",
    "check_fixed_sizes",
    "choose_layout",
    "format_table",
    "layouts",
    "measure_row",
    "model_shape",
    "predict",
    "ranked_table",
]

logger = logging.getLogger(__name__)

# (config key, mesh axis, Layout field), in the mesh's order from the major axis.
_AXES = (
    ("pipeline.stages", "pipe"),
    ("expert_parallel.autoep_size", "expert"),
    ("sequence_parallel_size", "seq"),
    ("tensor_parallel.autotp_size", "model"),
)
_ACCUM = "gradient_accumulation_steps"
_MAX_ACCUMULATION = 8  # micro-batches tried beyond what a pipeline needs: a bounded search


@dataclass(frozen=True)
class Rates:
    """What the cost model divides by: bandwidths in GB/s, TFLOP/s per device, microseconds."""

    intra_host_gbps: float
    inter_host_gbps: float
    tflops: float
    latency_us: float

    @classmethod
    def of(cls, section: Any, platform: str) -> Rates:
        """The config's ``auto_layout`` section over the platform's defaults."""
        base = PLATFORM_RATES.get(platform, PLATFORM_RATES["cpu"])
        given = {f.name: getattr(section, f.name, None) for f in dataclasses.fields(cls)}
        return dataclasses.replace(base, **{k: v for k, v in given.items() if v is not None})


PLATFORM_RATES = {
    "gpu": Rates(intra_host_gbps=300.0, inter_host_gbps=25.0, tflops=200.0, latency_us=10.0),
    "tpu": Rates(intra_host_gbps=100.0, inter_host_gbps=25.0, tflops=100.0, latency_us=10.0),
    "cpu": Rates(intra_host_gbps=10.0, inter_host_gbps=1.0, tflops=0.05, latency_us=20.0),
}
"""Default rates per platform (``cuda``/``rocm`` read as ``gpu``): round figures of an NVLink
GPU node with a 200 Gb/s NIC per GPU, a TPU slice, and a CPU host's shared memory. Set
``auto_layout`` in the config to your machine's."""


@dataclass(frozen=True)
class Layout:
    """One mesh: the size of each axis, and the micro-batches a step accumulates."""

    data: int
    model: int = 1
    seq: int = 1
    pipe: int = 1
    expert: int = 1
    replica: int = 1
    accumulation: int = 1
    schedule: str = "1f1b"  # the pipeline's (its bubble and messages), from the config
    virtual: int = 1

    @property
    def rows_split(self) -> int:
        """Devices the batch's rows are split over (``replica`` x ``data`` x ``expert``)."""
        return self.replica * self.data * self.expert

    @property
    def name(self) -> str:
        axes = ("replica", "pipe", "data", "expert", "seq", "model")
        parts = [f"{a} {getattr(self, a)}" for a in axes if getattr(self, a) > 1 or a == "data"]
        text = " x ".join(parts)
        return text + (f", {self.accumulation} micro" if self.accumulation > 1 else "")

    def config(self, cfg: config_lib.Config) -> config_lib.Config:
        """``cfg`` with this layout's concrete sizes, micro batch and accumulation."""
        tp = dict(cfg.tensor_parallel or {}, autotp_size=self.model)
        pipe = dict(cfg.pipeline or {}, stages=self.pipe)
        ep = dict(cfg.expert_parallel or {}, autoep_size=self.expert)
        rows = cfg.train_batch_size
        return dataclasses.replace(
            cfg,
            tensor_parallel=config_lib.FrozenMap(tp),
            pipeline=config_lib.FrozenMap(pipe),
            expert_parallel=(
                config_lib.FrozenMap(ep)
                if cfg.expert_parallel is not None or self.expert > 1
                else None
            ),
            sequence_parallel_size=self.seq,
            gradient_accumulation_steps=self.accumulation,
            train_micro_batch_size_per_gpu=rows // (self.accumulation * self.rows_split),
            auto=tuple(k for k in cfg.auto if k not in (*config_lib.LAYOUT_KEYS, _ACCUM)),
        )


@dataclass(frozen=True)
class ModelShape:
    """What the model and the batch allow and cost: read from the config, the parameters and
    one trace of the loss. ``None``: unknown (the axis it would divide stays 1)."""

    devices: int
    local_devices: int
    rows: int
    params: int
    grad_bytes: int
    act_bytes: int
    flops: float
    hidden: int
    seq_len: int | None = None
    heads: int | None = None
    layers: int | None = None
    experts: int | None = None
    experts_per_token: int = 2


def _pow2_divisors(n: int) -> list[int]:
    return [d for d in (2**i for i in range(n.bit_length())) if n % d == 0]


def _divides(n: int | None, size: int) -> bool:
    return size == 1 or (n is not None and n % size == 0)


def check_fixed_sizes(cfg: config_lib.Config, devices: int) -> None:
    """With a parallel size ``"auto"``, each one written as a number must divide the devices
    (the others' powers of two are tried beside it): a clear error otherwise."""
    allowed = ", ".join(map(str, _pow2_divisors(devices)))
    autos = [k for k in config_lib.LAYOUT_KEYS if k in cfg.auto]
    for key, axis in _AXES:
        size = dict(_sizes(cfg))[axis]
        if key in cfg.auto or devices % size == 0:
            continue
        raise config_lib.ConfigError(
            f"{key}: {size} does not divide the {devices} devices, so with {', '.join(autos)} "
            f'"auto" no layout of them has it. The sizes tried are powers of two dividing '
            f'{devices} ({allowed}); set {key} to one of those, or to "auto".'
        )
    if cfg.train_batch_size is None:
        raise config_lib.ConfigError(
            f'{", ".join(autos)} "auto" chooses the layout for a fixed global batch, but '
            "train_batch_size is not set; set train_batch_size (e.g. train_batch_size: 32), and "
            'leave gradient_accumulation_steps "auto" to let it vary with the layout.'
        )


def _sizes(cfg: config_lib.Config) -> list[tuple[str, int]]:
    return [
        ("pipe", cfg.pipeline_stages()),
        ("expert", cfg.autoep_size()),
        ("seq", cfg.sequence_parallel_size),
        ("model", cfg.autotp_size()),
    ]


def _choices(cfg: config_lib.Config, shape: ModelShape) -> dict[str, list[int]]:
    """The sizes each axis may take: its powers of two where ``"auto"``, else its own."""
    fixed = dict(_sizes(cfg))
    allows = {
        "model": lambda s: _divides(shape.heads, s),
        "seq": lambda s: _divides(shape.heads, s) and _divides(shape.seq_len, s),
        "pipe": lambda s: _divides(shape.layers, s * cfg.pipeline_virtual_stages()),
        "expert": lambda s: _divides(shape.experts, s),
    }
    out = {}
    for key, axis in _AXES:
        if key in cfg.auto:
            out[axis] = [s for s in _pow2_divisors(shape.devices) if allows[axis](s)]
        else:
            out[axis] = [fixed[axis]]
    return out


def layouts(cfg: config_lib.Config, shape: ModelShape) -> list[Layout]:
    """Every layout of ``shape.devices`` the model and the batch allow (see the module's
    decisions), in no particular order."""
    choices = _choices(cfg, shape)
    replica = max(1, int(cfg.mesh.sizes().get("replica", 1)))
    micro = cfg.train_micro_batch_size_per_gpu
    out = []
    for pipe, expert, seq, model in itertools.product(*(choices[a] for _, a in _AXES)):
        inner = model * seq * expert  # the minor axes: within one host
        if shape.local_devices % inner or not _divides(shape.heads, model * seq):
            continue  # Ulysses splits the heads of a model axis' share again
        rest, left = divmod(shape.devices, inner * pipe * replica)
        if left or rest < 1:
            continue
        layout = Layout(rest, model, seq, pipe, expert, replica, 1, cfg.pipeline_schedule(),
                        cfg.pipeline_virtual_stages())  # fmt: skip
        for accum in _accumulations(cfg, layout, shape.rows, micro):
            out.append(dataclasses.replace(layout, accumulation=accum))
    return out


def _accumulations(
    cfg: config_lib.Config, layout: Layout, rows: int, micro: int | None
) -> list[int]:
    """The micro-batch counts a layout's batch allows: the rows split evenly, at least ``pipe``
    of them; ``gradient_accumulation_steps`` varies only where it is ``"auto"``."""
    split = layout.rows_split
    if micro is not None:
        options = [rows // (micro * split)] if rows % (micro * split) == 0 else []
    elif _ACCUM in cfg.auto:
        top = max(_MAX_ACCUMULATION, 2 * layout.pipe)
        options = [a for a in _pow2_divisors(rows) if a <= top]
    else:
        options = [cfg.gradient_accumulation_steps or 1]
    grouped = layout.schedule == "interleaved_1f1b" and layout.pipe > 1  # in groups of pipe
    return [a for a in options if a >= 1 and rows % (a * split) == 0 and a >= layout.pipe
            and not (grouped and a % layout.pipe)]  # fmt: skip


@dataclass(frozen=True)
class Prediction:
    """A candidate's predicted bytes per step on each axis (per device, on the wire), its
    step time and the part of it spent computing."""

    axis_bytes: dict[str, float]
    seconds: float
    compute_seconds: float


def _crosses_hosts(layout: Layout, axis: str, local: int) -> bool:
    """Whether ``axis``'s groups span devices of several hosts: the axes from it to the minor
    end of the mesh hold more devices than a host."""
    order = ("replica", "pipe", "data", "expert", "seq", "model")
    minor = order[order.index(axis) :]
    return math.prod(getattr(layout, a) for a in minor) > local


def predict(layout: Layout, stage: StageCandidate, shape: ModelShape, rates: Rates) -> Prediction:
    """The cost model of the module's decisions."""
    t, p, m = layout.model, layout.pipe, layout.accumulation
    ring = lambda n: (n - 1) / n  # noqa: E731
    local_params = shape.params / (t * p)
    group = layout.data * layout.seq * layout.expert * layout.replica
    layers = (shape.layers or 1) / p
    micro_rows = shape.rows / (m * layout.rows_split)
    x = micro_rows * (shape.seq_len or 1) / layout.seq * shape.hidden  # activations per device
    ab = shape.act_bytes
    out: dict[str, float] = {}
    count: dict[str, float] = {}
    spec = stage_spec(stage.stage)  # the stage table's traffic: 2 Psi, or 3 Psi with params
    out["data"] = spec.traffic()[0] * local_params * shape.grad_bytes * ring(group)
    if spec.shard_params:  # each layer gathered forward and backward, then the rest once
        count["data"] = 2 * layers * m + 1
    else:  # a reduce-scatter and an all-gather, or one all-reduce
        count["data"] = 2 if spec.reduce_scatter else 1
    if t > 1:
        out["model"] = m * layers * 4 * 2 * x * ab * ring(t)
        count["model"] = m * layers * 4
    if layout.seq > 1:
        out["seq"] = m * layers * 8 * (x / t) * ab * ring(layout.seq)
        count["seq"] = m * layers * 8
    if layout.expert > 1:
        out["expert"] = m * layers * 4 * shape.experts_per_token * x * ab * ring(layout.expert)
        count["expert"] = m * layers * 4
    if p > 1:  # each micro-batch across each stage's (each chunk's) boundary, both ways
        out["pipe"] = 2 * m * layout.virtual * x / t * ab
        count["pipe"] = 2 * m * layout.virtual
    if stage.offload:  # gradients to the host, parameters back: at the inter-host rate
        out["host"] = 2 * local_params * shape.grad_bytes / group
        count["host"] = 2
    comm = 0.0
    for axis, nbytes in out.items():
        cross = axis == "host" or _crosses_hosts(layout, axis, shape.local_devices)
        gbps = rates.inter_host_gbps if cross else rates.intra_host_gbps
        comm += nbytes / (gbps * 1e9) + count[axis] * rates.latency_us * 1e-6
    work = shape.flops * (4 / 3 if stage.checkpointing else 1.0)
    compute = work / (shape.devices * rates.tflops * 1e12) / (1 - _bubble(layout))
    return Prediction(out, compute + comm, compute)


def _bubble(layout: Layout) -> float:
    """The pipeline schedule's idle fraction from its table (``(P-1)/(M+P-1)`` for 1F1B and
    GPipe), or 0 without a pipeline."""
    if layout.pipe <= 1:
        return 0.0
    schedule = make_schedule(layout.schedule, layout.pipe, layout.accumulation, layout.virtual)
    return schedule.bubble


@dataclass(frozen=True)
class Row:
    """One ranked candidate: its layout and stage, prediction, and (once compiled) its need."""

    layout: Layout
    stage: StageCandidate
    prediction: Prediction
    need: int | None = None
    error: str | None = None

    @property
    def name(self) -> str:
        return f"{self.layout.name}, {self.stage.name}"

    def config(self, cfg: config_lib.Config) -> config_lib.Config:
        return self.stage.config(self.layout.config(cfg))


@dataclass
class AutoLayout:
    """What an engine needs to choose its layout at the first batch.

    Attributes:
      budget: bytes per device a step may use.
      stages: the stage candidates (:func:`jzero.engine.auto_stage.candidates`, or the one
        configured), in the planner's order.
      rates: the cost model's rates.
      planner: ``planner(config)`` builds that config's mesh and AutoTP specs and returns the
        ``make_plan`` partial ``(**replan_kwargs) -> Plan``.
      keys: the keys written ``"auto"`` (``Config.auto`` as loaded; ``initialize`` empties it).
      only: a layout to try alone (a checkpoint's, restored before the first step).
    """

    budget: int
    stages: Sequence[StageCandidate]
    rates: Rates
    planner: Callable[[config_lib.Config], Callable[..., Any]]
    keys: tuple[str, ...] = ()
    only: Layout | None = None

    def ranked(self, cfg: config_lib.Config, shape: ModelShape) -> list[Row]:
        """Every candidate, predicted fastest first; a ``ConfigError`` naming what the model
        and batch allow where there is none."""
        cfg = dataclasses.replace(cfg, auto=self.keys)
        found = [self.only] if self.only is not None else layouts(cfg, shape)
        if not found:
            raise config_lib.ConfigError(
                f"No layout of {shape.devices} devices fits the global batch of {shape.rows} "
                f"rows with the sizes allowed ({_allowed(cfg, shape)}): the rows must divide by "
                "replica x data x expert x micro-batches, and a pipeline needs at least `stages` "
                'micro-batches. Change train_batch_size, write more sizes as "auto", or set '
                "gradient_accumulation_steps: auto."
            )
        rows = [
            Row(lay, st, predict(lay, st, shape, self.rates)) for lay in found for st in self.stages
        ]
        order = {st: i for i, st in enumerate(self.stages)}
        rows.sort(key=lambda r: (r.prediction.seconds, order[r.stage], r.layout.data * -1))
        return rows

    def no_fit(self, tried: Sequence[Row]) -> config_lib.ConfigError:
        needs = "; ".join(
            f"{r.name} needs {format_bytes(r.need)}"
            if r.need is not None
            else f"{r.name}: {r.error}"
            for r in tried
        )
        return config_lib.ConfigError(
            f"auto layout found no layout that fits {format_bytes(self.budget)} per device: "
            f"{needs}. Use more devices, a smaller train_batch_size, gradient_accumulation_steps: "
            "auto, activation_checkpointing: {policy: auto} with stage: auto, or raise "
            "device_memory if the device has more."
        )

    def describe(self, chosen: Row, rejected: Sequence[Row]) -> str:
        line = (
            f"jzero: auto layout chose {chosen.name}: its step needs {format_bytes(chosen.need)} "
            f"per device of {format_bytes(self.budget)}, predicted "
            f"{chosen.prediction.seconds * 1e3:.3g} ms a step"
        )
        if rejected:
            line += "; rejected " + ", ".join(
                f"{r.name} (short by {format_bytes(r.need - self.budget)})"
                if r.need is not None
                else f"{r.name} ({r.error})"
                for r in rejected
            )
        return line


def _allowed(cfg: config_lib.Config, shape: ModelShape) -> str:
    return "; ".join(f"{a} in {c}" for a, c in _choices(cfg, shape).items())


def model_shape(setup: Any, batch: Any, keys: Sequence[str] = ()) -> ModelShape:
    """The :class:`ModelShape` of the model of ``setup`` (a :class:`jzero.engine.resolve.Setup`)
    on a global ``batch`` (shapes suffice)."""
    from jzero.engine import figures, layout

    cfg = setup.config
    params = jax.tree.leaves(setup.plan.abstract_params)
    itemsize = max(np.dtype(x.dtype).itemsize for x in params)
    half = cfg.bf16.enabled or cfg.fp16.enabled
    comm = {"fp32": 4, "fp16": 2, "bf16": 2}.get(cfg.communication_data_type or "", 0)
    lasts = Counter(int(x.shape[-1]) for x in params if len(x.shape) >= 2)
    hidden = cfg.model.get("d_model") or (lasts.most_common(1)[0][0] if lasts else 1)
    tp = cfg.tensor_parallel or {}
    heads = tp.get("num_heads", cfg.model.get("num_heads"))
    leaves = jax.tree.leaves(batch)
    seq_len = cfg.model.get("seq_len") or next(
        (x.shape[1] for x in leaves if len(x.shape) >= 2), None
    )
    layers = cfg.model.get("num_layers")
    if layers is None and "pipeline.stages" in keys:
        dims, _ = layout.traced_layers(setup, batch)
        found = [x.shape[d] for x, d in zip(params, dims, strict=True) if d is not None]
        layers = max(found) if found else None
    return ModelShape(
        devices=jax.device_count(),
        local_devices=jax.local_device_count(),
        rows=int(cfg.train_batch_size),
        params=sum(math.prod(x.shape) for x in params),
        grad_bytes=comm or (2 if half else itemsize),
        act_bytes=2 if half else itemsize,
        flops=figures.model_flops(setup, batch),
        hidden=int(hidden),
        seq_len=int(seq_len) if seq_len else None,
        heads=int(heads) if heads else None,
        layers=int(layers) if layers else None,
        experts=cfg.num_experts(),
        experts_per_token=int(cfg.model.get("experts_per_token", 2)),
    )


@dataclass
class Choice:
    """The layout chosen: its config, plan, step (compiled), ``replan`` and batch sizes."""

    config: config_lib.Config
    plan: Any
    step: Any
    replan: Callable[..., Any]
    sizes: tuple[int, int, int]
    row: Row


def _global_shapes(batch: Any, rows: int) -> Any:
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct((rows, *np.shape(x)[1:]), x.dtype), batch)


def _as_step_takes(raw: Any, plan: Any, rows: int) -> Any:
    """The global batch as the step will be called with it (so that its first call finds the
    executable compiled here): the engine's ``global_batch`` of concrete rows, else shapes."""
    from jzero import distributed

    if any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(raw)):
        return _global_shapes(raw, rows)
    return distributed.global_batch(raw, plan.batch, rows)


def _measure(auto: AutoLayout, setup: Any, raw: Any, row: Row) -> tuple[int, Any]:
    """A candidate's compiled peak and what it built: config, plan, step, replan."""
    from jzero.engine import layout

    cfg = row.config(setup.config)
    batch = _global_shapes(raw, int(cfg.train_batch_size))
    replan = auto.planner(cfg)
    sizes = (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, row.layout.accumulation)
    candidate = dataclasses.replace(setup, config=cfg, plan=replan(), sizes=sizes)
    dims, piped = layout.traced_layers(candidate, batch)
    plan = replan(layer_dims=dims, **piped)
    placed = _as_step_takes(raw, plan, int(cfg.train_batch_size))
    need, step = compiled_need(dataclasses.replace(candidate, plan=plan), placed)
    return need, (cfg, plan, step, replan)


def _tried(auto: AutoLayout, setup: Any, batch: Any, row: Row) -> tuple[Row, Any]:
    """``row`` with its compiled need and what it built, or with the error that refused it
    (a layout the model refuses) and ``None``."""
    try:
        need, built = _measure(auto, setup, batch, row)
    except (ValueError, config_lib.ConfigError) as e:
        return dataclasses.replace(row, error=str(e).split(";")[0][:160]), None
    return dataclasses.replace(row, need=need), built


def choose_layout(auto: AutoLayout, setup: Any, batch: Any) -> Choice:
    """The candidate ``auto`` keeps for the step of ``setup`` (a
    :class:`jzero.engine.resolve.Setup`) on ``batch`` (this process's rows; shapes suffice):
    compiled in rank order, the first that fits kept; one log line."""
    shape = model_shape(setup, _global_shapes(batch, int(setup.config.train_batch_size)), auto.keys)
    tried: list[Row] = []
    for row in auto.ranked(setup.config, shape):
        row, built = _tried(auto, setup, batch, row)
        if built is not None and row.need <= auto.budget:
            cfg, plan, step, replan = built
            logger.info(auto.describe(row, tried))
            lay = row.layout
            sizes = (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, lay.accumulation)
            return Choice(cfg, plan, step, replan, sizes, row)
        tried.append(row)
    raise auto.no_fit(tried)


def measure_row(auto: AutoLayout, setup: Any, batch: Any, row: Row) -> Row:
    """``row`` with its compiled need (or the error that refused it), on the global ``batch``."""
    return _tried(auto, setup, batch, row)[0]


def ranked_table(auto: AutoLayout, setup: Any, batch: Any, *, measure: bool = True) -> list[Row]:
    """Every candidate in rank order for ``setup`` (a :class:`jzero.engine.resolve.Setup`, e.g.
    ``engine.setup``), each compiled for its need when ``measure`` (``jzero plan --auto``):
    nothing is kept or trained."""
    shape = model_shape(setup, _global_shapes(batch, int(setup.config.train_batch_size)), auto.keys)
    rows = auto.ranked(setup.config, shape)
    if not measure:
        return rows
    return [measure_row(auto, setup, batch, row) for row in rows]


def format_table(rows: Sequence[Row], budget: int) -> str:
    """``jzero plan --auto``'s table: layout, stage, predicted step, bytes per axis, compiled
    need, whether it fits; the first that fits is the one ``"auto"`` keeps."""
    head = f"{'#':>3}  {'layout':<34} {'stage':<30} {'pred ms':>9}  {'need':>10}  fits  bytes/axis"
    lines = [f"auto layout within {format_bytes(budget)} per device, predicted fastest first", head]
    chosen = False
    for i, r in enumerate(rows, 1):
        fits = r.need is not None and r.need <= budget
        mark = "yes" if fits else ("-" if r.need is None else "no")
        if fits and not chosen:
            mark, chosen = "KEPT", True
        need = format_bytes(r.need) if r.need is not None else (r.error or "-")[:10]
        axes = ", ".join(f"{a} {format_bytes(int(b))}" for a, b in r.prediction.axis_bytes.items())
        lines.append(
            f"{i:>3}  {r.layout.name:<34} {r.stage.name:<30} "
            f"{r.prediction.seconds * 1e3:>9.3f}  {need:>10}  {mark:<4}  {axes}"
        )
    return "\n".join(lines)


def adopt_saved(auto: AutoLayout, saved: Any) -> None:
    """Narrows ``auto`` to the layout (and stage) a checkpoint's config recorded, so an engine
    restored before its first step compiles that one only (still checked against the budget)."""
    if not isinstance(saved, dict):
        return
    cfg = config_lib.load_config(saved)
    if any(k in cfg.auto for k in (*config_lib.LAYOUT_KEYS, _ACCUM)) or not cfg.train_batch_size:
        return  # saved before a choice: nothing recorded
    sizes = dict(_sizes(cfg))
    rest = jax.device_count() // math.prod(sizes.values())
    replica = max(1, int(cfg.mesh.sizes().get("replica", 1)))
    auto.only = Layout(
        rest // replica,
        model=sizes["model"],
        seq=sizes["seq"],
        pipe=sizes["pipe"],
        expert=sizes["expert"],
        replica=replica,
        accumulation=int(cfg.gradient_accumulation_steps or 1),
        schedule=cfg.pipeline_schedule(),
        virtual=cfg.pipeline_virtual_stages(),
    )
    zero = cfg.zero_optimization
    same = [
        s
        for s in auto.stages
        if s.stage == zero.stage and s.offload == (zero.offload_optimizer.device == "cpu")
    ]
    auto.stages = same or auto.stages
