"""The one table of what each ZeRO stage shards.

No other module branches on the stage number: the plan reads this table, and everything else
(the step, offload, checkpoints, the memory report) reads the plan.

| stage | params at rest | gradients                                  | optimizer state |
|-------|----------------|--------------------------------------------|-----------------|
| 0     | replicated     | all-reduce once per step                   | replicated      |
| 1     | replicated     | full local accumulation, one reduce-scatter| sharded         |
| 2     | replicated     | reduce-scatter every micro-batch           | sharded         |
| 3     | sharded        | reduce-scatter every micro-batch           | sharded         |
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["StageSpec", "STAGES", "stage_spec"]


@dataclass(frozen=True)
class StageSpec:
    """What one ZeRO stage does.

    Attributes:
      stage: the DeepSpeed stage number.
      shard_params: parameters rest sharded over the data axis and are gathered when used.
      shard_grads: gradients are reduce-scattered after every micro-batch and only the local
        shard is accumulated (otherwise the full local gradient is accumulated).
      shard_opt_state: optimizer state (and the update) is sharded over the data axis.
      description: one line for reports.
    """

    stage: int
    shard_params: bool
    shard_grads: bool
    shard_opt_state: bool
    description: str

    @property
    def reduce_scatter(self) -> bool:
        """Gradients leave the reduction sharded (a reduce-scatter, not an all-reduce)."""
        return self.shard_opt_state


STAGES: dict[int, StageSpec] = {
    0: StageSpec(0, False, False, False, "data parallel: everything replicated"),
    1: StageSpec(1, False, False, True, "optimizer state sharded"),
    2: StageSpec(2, False, True, True, "optimizer state and gradients sharded"),
    3: StageSpec(3, True, True, True, "optimizer state, gradients and parameters sharded"),
}


def stage_spec(stage: int) -> StageSpec:
    """Returns the table row for ``stage``, or a clear error for a stage that does not exist."""
    if isinstance(stage, bool) or stage not in STAGES:
        raise ValueError(
            f"zero_optimization.stage: {stage!r} is not a ZeRO stage; it must be one of "
            f"{', '.join(map(str, STAGES))}. Set zero_optimization.stage to 0, 1, 2 or 3."
        )
    return STAGES[stage]
