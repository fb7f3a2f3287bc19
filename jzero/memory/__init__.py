"""Memory planning: what each ZeRO stage needs per device, and the lowest stage that fits.

Three entry points share one report shape (rows of per-device bytes, a table, a plot and a
recommendation):

* :func:`estimate` is closed-form, for any model size and device count: the formulas of
  :mod:`jzero.costs` (the ZeRO paper's model-state bytes, DeepSpeed's estimators for offload
  and host memory, and, given a transformer's shape, its activations without and with full
  recomputation from Korthikanti et al. 2022) over its :class:`~jzero.costs.ModelShape` and
  :class:`~jzero.costs.ParallelDims`, checked, tabled and weighed here.
* :func:`measure_stages` measures a config's model at every stage: per-device bytes of each
  model-state category from the plan (``jzero.plan.model_state_bytes`` on the device,
  ``jzero.plan.host_state_bytes`` on the host), the largest leaf slice stage 3 gathers at once,
  and the compiled step's ``memory_analysis()``, with the config's activation checkpointing
  and the opposite setting (temporaries, peak). The model (and its engine) comes from the caller:
  ``jzero plan``'s measurement of the built-in GPT is :func:`jzero.demo.plan.plan_report`
  (this package imports neither the engine nor a model, nor reaches them by name;
  ``tests/project/test_house.py`` checks it).
* :func:`memory_report` is the same report for one existing engine (its own activation
  checkpointing only).

Every public name lives in one of the private modules below and is re-exported here, so
``jzero.memory.X`` is the one way to reach it:

* ``_format``: :func:`parse_size`, the argument checks, text tables and the
  :class:`Recommendation`, which weighs the levers in the order of their cost: the lowest stage
  that fits without activation checkpointing or offload, then activation checkpointing, then
  offload; it names the lever and how short every other option is.
* ``_estimate``: :func:`estimate` of a :class:`~jzero.costs.ModelShape` on a
  :class:`~jzero.costs.ParallelDims` (in :class:`~jzero.costs.Dtypes`), and the
  :class:`Estimate` / :class:`EstimateRow`.
* ``_sequence``: :func:`sequence_report` (and :meth:`Estimate.sequence_report`), the
  activations of long sequences with each long-context technique added in turn, and the
  longest sequence that fits: :class:`SequenceReport` / :class:`SequenceRow`.
* ``_report``: :class:`StageMemory` and :class:`PlanReport`, the measured report's rows and table.
* ``_measure``: :func:`measure_stages` and :func:`memory_report`, which compile.
* ``_plot``: :func:`plot_bars` (matplotlib, imported only when a plot is drawn).

Decisions common to all of them: sizes are printed in GiB (2^30 bytes), sizes written
``80GB`` are 10^9 bytes; "fits" keeps a margin of the device memory (10% by default) free.
Callers reach the entry points through this package's attributes (``memory.estimate``), so
replacing one here replaces it for them. The names load on first use
(:func:`jzero._util.lazy_exports`): :func:`estimate` is arithmetic and imports no JAX (only a
pipeline's schedule table does), the measured entry points import it when first read.
"""

from typing import TYPE_CHECKING

from jzero._util import lazy_exports

if TYPE_CHECKING:
    from jzero.memory._estimate import Estimate as Estimate
    from jzero.memory._estimate import EstimateRow as EstimateRow
    from jzero.memory._estimate import Offload as Offload
    from jzero.memory._estimate import estimate as estimate
    from jzero.memory._format import GB as GB
    from jzero.memory._format import GIB as GIB
    from jzero.memory._format import Recommendation as Recommendation
    from jzero.memory._format import parse_size as parse_size
    from jzero.memory._measure import StageRows as StageRows
    from jzero.memory._measure import measure_stages as measure_stages
    from jzero.memory._measure import memory_report as memory_report
    from jzero.memory._plot import plot_bars as plot_bars
    from jzero.memory._report import PlanReport as PlanReport
    from jzero.memory._report import StageMemory as StageMemory
    from jzero.memory._sequence import SequenceReport as SequenceReport
    from jzero.memory._sequence import SequenceRow as SequenceRow
    from jzero.memory._sequence import sequence_report as sequence_report

__all__ = [
    "Estimate",
    "EstimateRow",
    "PlanReport",
    "Recommendation",
    "SequenceReport",
    "SequenceRow",
    "StageMemory",
    "StageRows",
    "estimate",
    "measure_stages",
    "memory_report",
    "parse_size",
    "plot_bars",
    "sequence_report",
]

__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "Estimate": "jzero.memory._estimate.Estimate",
        "EstimateRow": "jzero.memory._estimate.EstimateRow",
        "Offload": "jzero.memory._estimate.Offload",
        "estimate": "jzero.memory._estimate.estimate",
        "GB": "jzero.memory._format.GB",
        "GIB": "jzero.memory._format.GIB",
        "Recommendation": "jzero.memory._format.Recommendation",
        "parse_size": "jzero.memory._format.parse_size",
        "StageRows": "jzero.memory._measure.StageRows",
        "measure_stages": "jzero.memory._measure.measure_stages",
        "memory_report": "jzero.memory._measure.memory_report",
        "plot_bars": "jzero.memory._plot.plot_bars",
        "PlanReport": "jzero.memory._report.PlanReport",
        "StageMemory": "jzero.memory._report.StageMemory",
        "SequenceReport": "jzero.memory._sequence.SequenceReport",
        "SequenceRow": "jzero.memory._sequence.SequenceRow",
        "sequence_report": "jzero.memory._sequence.sequence_report",
    },
)
