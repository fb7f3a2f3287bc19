"""The values a config names and the core acts on: stages, remat policies, pipeline schedules.

Import direction: imports nothing of jzero's and no JAX (nor NumPy, but in ``schedules``);
imported by :mod:`jzero.config` (which validates a user's choice against these tables), by the
core that acts on it (:mod:`jzero.plan` the stage table, :mod:`jzero.rewrite` the remat
policies and the memory kinds, :mod:`jzero.parallel.pipeline` the pipeline schedules) and by
the cost model (:mod:`jzero.costs`). One table each, read by both sides, so the config, the
core and the costs never disagree on what exists.

* :mod:`~jzero.choices.stages`: the one table of what each ZeRO stage shards, and every rule
  derived from its flags.
* :mod:`~jzero.choices.remat`: the names of ``activation_checkpointing.policy`` and how a
  value is read.
* :mod:`~jzero.choices.pipeline`: the names of ``pipeline.schedule``;
  :mod:`~jzero.choices.schedules` each schedule's tables (NumPy, loaded only where a layout has
  a pipeline).
"""

from jzero.choices.pipeline import SCHEDULES as SCHEDULES
from jzero.choices.remat import POLICIES as POLICIES
from jzero.choices.remat import parse_policy_text as parse_policy_text
from jzero.choices.stages import OFFLOADS as OFFLOADS
from jzero.choices.stages import STAGES as STAGES
from jzero.choices.stages import StageSpec as StageSpec
from jzero.choices.stages import check_offload as check_offload
from jzero.choices.stages import formula_text as formula_text
from jzero.choices.stages import stage_spec as stage_spec
from jzero.choices.stages import stages_allowing as stages_allowing

__all__ = [
    "OFFLOADS",
    "POLICIES",
    "SCHEDULES",
    "STAGES",
    "StageSpec",
    "check_offload",
    "formula_text",
    "parse_policy_text",
    "stage_spec",
    "stages_allowing",
]
