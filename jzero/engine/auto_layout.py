"""``"auto"`` parallel sizes: the layout (and stage) predicted fastest whose compiled step fits.

``tensor_parallel.autotp_size``, ``sequence_parallel_size``, ``context_parallel_size``,
``pipeline.stages``, ``expert_parallel.autoep_size`` (and ``gradient_accumulation_steps``
beside a fixed ``train_batch_size``) may be ``"auto"``, with ``zero_optimization.stage: auto``
or a fixed stage. At the first batch the engine enumerates the layouts the model and the batch
allow, ranks them by a cost model, compiles them in that order (abstract state: nothing is
allocated) and keeps the first whose compiled peak fits the budget, as
:mod:`jzero.engine.auto_stage` does for the stage.

Decisions:

* **Candidates** are every layout the model and batch allow: the sizes of the ``"auto"`` axes are
  powers of two dividing the device count (the others stay as written), their product with ``data``
  is the device count; the heads divide by ``model`` x ``seq``, the sequence length by ``seq`` and
  by ``2 context`` and ``context`` x ``seq`` (the ring's zig-zag chunks, split again by Ulysses),
  the stacked layers by ``pipe`` (with at least ``pipe`` micro-batches), the experts by ``expert``;
  the global batch's rows divide by the data-like axes (``replica`` x ``data`` x ``expert``) times
  the micro-batches. A batch of fewer rows than devices therefore needs a ``seq``, ``context``,
  ``model`` or ``pipe`` axis. An axis whose divisor is unknown (no ``num_heads`` in the ``model`` or
  ``tensor_parallel`` section, no layers traced, no experts, no sequence length) stays 1.
* **No candidate puts a ring inside a pipeline stage** (``context`` beside ``pipe``), though
  written by hand that layout trains: there the ring gathers each row's keys instead of
  passing them (:mod:`jzero.parallel.sequence.ring`), which the cost model (each device ``1/C``
  of the keys in flight) does not price.
* **Placement**: the axes that talk every layer (``model``, ``seq``, ``context``, ``expert``)
  are the mesh's minor axes (:func:`jzero.make_mesh`'s order), and a candidate is kept only
  where their product divides one process's devices, so each of their groups stays within a
  host; ``data``, ``pipe`` and ``replica`` may cross hosts, and the cost model prices an axis
  at the inter-host bandwidth where its group does.
* **Ranked by the cost model, before any compilation** (:func:`jzero.costs.predict`, the
  formulas ``jzero estimate`` counts with too). Lowered programs hold only the collectives jzero
  writes itself (its ``shard_map`` ZeRO step); tensor parallelism's and the GSPMD parts' appear
  only once XLA partitions the program, in compilation, which is the cost being avoided. So each
  candidate's bytes per axis are closed forms (:mod:`jzero.costs.traffic`), its time those
  bytes over each axis' bandwidth plus the model's FLOPs (:func:`jzero.engine.figures.model_flops`,
  traced) over the devices' rate. Rates: ``auto_layout`` in the config, else the platform's
  defaults (:data:`jzero.costs.PLATFORM_RATES`). Ties keep the planner's order of stages.
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
from jzero import costs
from jzero._util import format_bytes
from jzero.engine.auto_stage import Candidate as StageCandidate
from jzero.engine.auto_stage import compiled_need

__all__ = [
    "AutoLayout",
    "Choice",
    "Row",
    "adopt_saved",
    "check_fixed_sizes",
    "choose_layout",
    "devices_here",
    "format_table",
    "layouts",
    "measure_row",
    "model_shape",
    "ranked_table",
    "step_work",
]

logger = logging.getLogger(__name__)

# (config key, mesh axis), in the mesh's order from the major axis.
_AXES = (
    ("pipeline.stages", "pipe"),
    ("expert_parallel.autoep_size", "expert"),
    ("context_parallel_size", "context"),
    ("sequence_parallel_size", "seq"),
    ("tensor_parallel.autotp_size", "model"),
)
_ACCUM = "gradient_accumulation_steps"
_MAX_ACCUMULATION = 8  # micro-batches tried beyond what a pipeline needs: a bounded search


def _configured(cfg: config_lib.Config, layout: costs.ParallelDims) -> config_lib.Config:
    """``cfg`` with ``layout``'s concrete sizes, micro batch and accumulation."""
    tp = dict(cfg.tensor_parallel or {}, autotp_size=layout.model)
    pipe = dict(cfg.pipeline or {}, stages=layout.pipe)
    ep = dict(cfg.expert_parallel or {}, autoep_size=layout.expert)
    rows = cfg.train_batch_size
    return dataclasses.replace(
        cfg,
        tensor_parallel=config_lib.FrozenMap(tp),
        pipeline=config_lib.FrozenMap(pipe),
        expert_parallel=(
            config_lib.FrozenMap(ep)
            if cfg.expert_parallel is not None or layout.expert > 1
            else None
        ),
        sequence_parallel_size=layout.seq,
        context_parallel_size=layout.context,
        gradient_accumulation_steps=layout.micro_batches,
        train_micro_batch_size_per_gpu=rows // (layout.micro_batches * layout.batch_split),
        auto=tuple(k for k in cfg.auto if k not in (*config_lib.LAYOUT_KEYS, _ACCUM)),
    )


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
        ("context", cfg.context_parallel_size),
        ("seq", cfg.sequence_parallel_size),
        ("model", cfg.autotp_size()),
    ]


def _choices(cfg: config_lib.Config, shape: costs.ModelShape, devices: int) -> dict[str, list[int]]:
    """The sizes each axis may take: its powers of two where ``"auto"``, else its own."""
    fixed = dict(_sizes(cfg))
    allows = {
        "model": lambda s: _divides(shape.heads, s),
        "seq": lambda s: _divides(shape.heads, s) and _divides(shape.seq_len, s),
        "context": lambda c: _divides(shape.seq_len, 2 * c if c > 1 else 1),
        "pipe": lambda s: _divides(shape.layers, s * cfg.pipeline_virtual_stages()),
        "expert": lambda s: _divides(shape.experts or None, s),
    }
    out = {}
    for key, axis in _AXES:
        if key in cfg.auto:
            out[axis] = [s for s in _pow2_divisors(devices) if allows[axis](s)]
        else:
            out[axis] = [fixed[axis]]
    return out


def layouts(
    cfg: config_lib.Config, shape: costs.ModelShape, devices: costs.ParallelDims
) -> list[costs.ParallelDims]:
    """Every layout of ``devices`` (their count and per host; :func:`devices_here`) the model
    and the global batch (``train_batch_size``) allow (see the module's decisions), in no
    particular order."""
    choices = _choices(cfg, shape, devices.devices)
    replica = max(1, int(cfg.mesh.sizes().get("replica", 1)))
    rows, micro = int(cfg.train_batch_size), cfg.train_micro_batch_size_per_gpu
    out = []
    for pipe, expert, context, seq, model in itertools.product(*(choices[a] for _, a in _AXES)):
        inner = model * seq * expert * context  # the minor axes: within one host
        if devices.devices_per_node % inner or not _divides(shape.heads, model * seq):
            continue  # Ulysses splits the heads of a model axis' share again
        if context > 1 and (pipe > 1 or not _divides(shape.seq_len, context * seq)):
            continue  # no ring inside a stage (see above); Ulysses splits a member's tokens
        rest, left = divmod(devices.devices, inner * pipe * replica)
        if left or rest < 1:
            continue
        layout = dataclasses.replace(
            devices, replica=replica, model=model, seq=seq, context=context, pipe=pipe,
            expert=expert,
            micro_batches=1, schedule=cfg.pipeline_schedule(),
            virtual=cfg.pipeline_virtual_stages(),
        )  # fmt: skip
        for accum in _accumulations(cfg, layout, rows, micro):
            out.append(_with_micro_batches(layout, accum, rows))
    return out


def _with_micro_batches(layout: costs.ParallelDims, count: int, rows: int) -> costs.ParallelDims:
    """``layout`` with ``rows`` a step cut into ``count`` micro-batches."""
    micro = rows // (count * layout.batch_split)
    return dataclasses.replace(layout, micro_batches=count, micro_batch=micro)


def _accumulations(
    cfg: config_lib.Config, layout: costs.ParallelDims, rows: int, micro: int | None
) -> list[int]:
    """The micro-batch counts a layout's batch allows: the rows split evenly, at least ``pipe``
    of them; ``gradient_accumulation_steps`` varies only where it is ``"auto"``."""
    split = layout.batch_split
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
class Row:
    """One ranked candidate: its layout and stage, prediction, and (once compiled) its need."""

    layout: costs.ParallelDims
    stage: StageCandidate
    prediction: costs.Prediction
    need: int | None = None
    error: str | None = None

    @property
    def name(self) -> str:
        return f"{self.layout.name}, {self.stage.name}"

    def config(self, cfg: config_lib.Config) -> config_lib.Config:
        return self.stage.config(_configured(cfg, self.layout))


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
    rates: costs.Rates
    planner: Callable[[config_lib.Config], Callable[..., Any]]
    keys: tuple[str, ...] = ()
    only: costs.ParallelDims | None = None

    def ranked(
        self,
        cfg: config_lib.Config,
        shape: costs.ModelShape,
        work: costs.Work,
        devices: costs.ParallelDims,
    ) -> list[Row]:
        """Every candidate on ``devices`` (:func:`devices_here`), predicted fastest first; a
        ``ConfigError`` naming what the model and batch allow where there is none."""
        cfg = dataclasses.replace(cfg, auto=self.keys)
        found = [self.only] if self.only is not None else layouts(cfg, shape, devices)
        if not found:
            raise config_lib.ConfigError(
                f"No layout of {devices.devices} devices fits the global batch of "
                f"{cfg.train_batch_size} rows with the sizes allowed "
                f"({_allowed(cfg, shape, devices.devices)}): the rows must divide by "
                "replica x data x expert x micro-batches, and a pipeline needs at least `stages` "
                'micro-batches. Change train_batch_size, write more sizes as "auto", or set '
                "gradient_accumulation_steps: auto."
            )
        rows = [
            Row(lay, st, costs.predict(lay, st, shape, work, self.rates))
            for lay in found
            for st in self.stages
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


def _allowed(cfg: config_lib.Config, shape: costs.ModelShape, devices: int) -> str:
    return "; ".join(f"{a} in {c}" for a, c in _choices(cfg, shape, devices).items())


def devices_here() -> costs.ParallelDims:
    """This run's devices, their count and per host (one process's), every axis 1: what the
    candidates lay out."""
    return costs.ParallelDims(jax.device_count(), jax.local_device_count())


def step_work(setup: Any, batch: Any) -> costs.Work:
    """What a step of the model of ``setup`` (a :class:`jzero.engine.resolve.Setup`) does on a
    global ``batch`` (shapes suffice): its FLOPs (traced), and the bytes of a gradient element on
    the wire (``communication_data_type``, else 16-bit under bf16 or fp16, else the params') and
    of an activation element."""
    from jzero.engine import figures

    cfg = setup.config
    params = jax.tree.leaves(setup.plan.abstract_params)
    itemsize = max(np.dtype(x.dtype).itemsize for x in params)
    half = cfg.bf16.enabled or cfg.fp16.enabled
    comm = {"fp32": 4, "fp16": 2, "bf16": 2}.get(cfg.communication_data_type or "", 0)
    return costs.Work(
        flops=figures.model_flops(setup, batch),
        grad_bytes=comm or (2 if half else itemsize),
        act_bytes=2 if half else itemsize,
    )


def model_shape(setup: Any, batch: Any, keys: Sequence[str] = ()) -> costs.ModelShape:
    """The :class:`jzero.costs.ModelShape` of the model of ``setup`` (a
    :class:`jzero.engine.resolve.Setup`) on a global ``batch`` (shapes suffice): its hidden size,
    heads and sequence length from the config's ``model`` section or the parameters and batch,
    its layers from the config or (with ``pipeline.stages`` among ``keys``) the loss's trace."""
    from jzero.engine import layout

    cfg = setup.config
    params = jax.tree.leaves(setup.plan.abstract_params)
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
    return costs.ModelShape(
        params=sum(math.prod(x.shape) for x in params),
        hidden=int(hidden),
        seq_len=int(seq_len) if seq_len else None,
        heads=int(heads) if heads else None,
        layers=int(layers) if layers else None,
        experts=cfg.num_experts() or 0,
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
    sizes = (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, row.layout.micro_batches)
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


def _ranked(auto: AutoLayout, setup: Any, batch: Any) -> list[Row]:
    """Every candidate for the step of ``setup`` on ``batch`` (this process's rows; shapes
    suffice) on this run's devices, in rank order."""
    shapes = _global_shapes(batch, int(setup.config.train_batch_size))
    shape = model_shape(setup, shapes, auto.keys)
    return auto.ranked(setup.config, shape, step_work(setup, shapes), devices_here())


def choose_layout(auto: AutoLayout, setup: Any, batch: Any) -> Choice:
    """The candidate ``auto`` keeps for the step of ``setup`` (a
    :class:`jzero.engine.resolve.Setup`) on ``batch`` (this process's rows; shapes suffice):
    compiled in rank order, the first that fits kept; one log line."""
    tried: list[Row] = []
    for row in _ranked(auto, setup, batch):
        row, built = _tried(auto, setup, batch, row)
        if built is not None and row.need <= auto.budget:
            cfg, plan, step, replan = built
            logger.info(auto.describe(row, tried))
            lay = row.layout
            sizes = (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, lay.micro_batches)
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
    rows = _ranked(auto, setup, batch)
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
    replica = max(1, int(cfg.mesh.sizes().get("replica", 1)))
    layout = dataclasses.replace(
        devices_here(),
        replica=replica,
        model=sizes["model"],
        seq=sizes["seq"],
        context=sizes["context"],
        pipe=sizes["pipe"],
        expert=sizes["expert"],
        schedule=cfg.pipeline_schedule(),
        virtual=cfg.pipeline_virtual_stages(),
    )
    count = int(cfg.gradient_accumulation_steps or 1)
    auto.only = _with_micro_batches(layout, count, int(cfg.train_batch_size))
    zero = cfg.zero_optimization
    same = [
        s
        for s in auto.stages
        if s.stage == zero.stage and s.offload == (zero.offload_optimizer.device == "cpu")
    ]
    auto.stages = same or auto.stages
