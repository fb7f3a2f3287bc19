"""The one table of what each ZeRO stage shards.

No other module branches on the stage number: the plan reads this table, and everything else
(the step, offload, checkpoints, the memory report) reads the plan. It sits in
:mod:`jzero.choices`, below both the config and the plan, so the config validates a stage (and
what it allows) against the same rows the plan is made from; ``jzero.plan.stages`` is this
module. What a stage allows and costs is derived from the row's flags here, once: which offload
it permits (:attr:`StageSpec.offloads`), its model-state bytes
(:meth:`StageSpec.model_state_bytes`, the ZeRO paper's formulas, rendered by
:func:`formula_text`) and its traffic (:meth:`StageSpec.traffic`). Change a flag and every rule
follows.

| stage | params at rest | gradients                                  | optimizer state |
|-------|----------------|--------------------------------------------|-----------------|
| 0     | replicated     | all-reduce once per step                   | replicated      |
| 1     | replicated     | full local accumulation, one reduce-scatter| sharded         |
| 2     | replicated     | reduce-scatter every micro-batch           | sharded         |
| 3     | sharded        | reduce-scatter every micro-batch           | sharded         |
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "HOST_MEMORY_KINDS",
    "OFFLOADS",
    "PINNED_HOST",
    "STAGES",
    "UNPINNED_HOST",
    "StageSpec",
    "check_offload",
    "formula_text",
    "stage_spec",
    "stages_allowing",
]

# The offload options, cheapest first: the optimizer state (and the master weights) in host
# memory, then the parameters too.
OFFLOADS = ("none", "optimizer", "optimizer+params")
# The JAX memory kinds offloaded state rests in (``pin_memory: true``, DeepSpeed's default, is
# pinned_host: page-locked host memory the device copies from directly), and where activation
# checkpointing's ``cpu_checkpointing`` keeps the saved activations.
PINNED_HOST = "pinned_host"
UNPINNED_HOST = "unpinned_host"
HOST_MEMORY_KINDS = (PINNED_HOST, UNPINNED_HOST)


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

    @property
    def offloads(self) -> tuple[str, ...]:
        """The offload options this stage allows (of :data:`OFFLOADS`): what is sharded may
        live in host memory, as DeepSpeed offloads only partitions: the optimizer state where
        it is sharded, the parameters too where they are."""
        allowed = {"none": True, "optimizer": self.shard_opt_state}
        allowed["optimizer+params"] = self.shard_params
        return tuple(o for o in OFFLOADS if allowed[o])

    def model_state_bytes(self, psi: float, n: int, k: float = 12) -> dict[str, float]:
        """Per-device bytes of the model states (the ZeRO paper, mixed-precision Adam): 16-bit
        params 2 Psi and grads 2 Psi, optimizer state (fp32 master, momentum, variance) K Psi;
        each divided by the ``n`` devices where this stage shards it."""
        return {
            "params": 2 * psi / (n if self.shard_params else 1),
            "grads": 2 * psi / (n if self.shard_grads else 1),
            "optimizer state": k * psi / (n if self.shard_opt_state else 1),
        }

    def formula(self, k: int = 12) -> str:
        """:meth:`model_state_bytes` as text, e.g. ``4 Psi + 12 Psi/N``."""
        whole = {True: 0, False: 0}
        for sharded, size in (
            (self.shard_params, 2),
            (self.shard_grads, 2),
            (self.shard_opt_state, k),
        ):
            whole[sharded] += size
        terms = [f"{whole[False]} Psi"] if whole[False] else []
        terms += [f"{whole[True]} Psi/N"] if whole[True] else []
        return " + ".join(terms)

    def traffic(self) -> tuple[float, str]:
        """Elements communicated per step per parameter, and how: sharded params are gathered
        in the forward and again in the backward pass and their gradients reduce-scattered;
        sharded gradients are reduce-scattered and the updated params all-gathered; else one
        all-reduce (2 Psi on the wire)."""
        if self.shard_params:
            return 3.0, "2 Psi all-gather + Psi reduce-scatter"
        if self.reduce_scatter:
            return 2.0, "Psi reduce-scatter + Psi all-gather"
        return 2.0, "2 Psi all-reduce"

    def replica_traffic(self, shards: int) -> tuple[float, str]:
        """Elements per parameter that cross the replica axis per step under hybrid sharding
        (``shards`` devices per ``data`` group): where the gradient is reduce-scattered only
        its shard crosses, all-reduced over the replicas (``2 Psi/shards`` on the wire; hpZ's
        reduce-scatter plus all-gather of the same shard moves as much); else the whole
        gradient is all-reduced over every device (``2 Psi``)."""
        if self.reduce_scatter:
            return 2.0 / shards, f"2 Psi/{shards} all-reduce of the gradient shards"
        return 2.0, "2 Psi all-reduce"


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


def stages_allowing(offload: str) -> list[int]:
    """The stages whose row allows ``offload`` (one of :data:`OFFLOADS`)."""
    return [spec.stage for spec in STAGES.values() if offload in spec.offloads]


def formula_text(k: int = 12) -> str:
    """Per-device model-state bytes of every stage, one line: ``stage 0 16 Psi, ...``."""
    return ", ".join(f"stage {s.stage} {s.formula(k)}" for s in STAGES.values())


def _stages_text(stages: list[int]) -> str:
    """``1, 2 or 3``."""
    names = [str(s) for s in stages]
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]


# The config key of each offload option that moves something to host memory.
_OFFLOAD_KEYS = {"optimizer": "offload_optimizer", "optimizer+params": "offload_param"}


def check_offload(spec: StageSpec, offload: str) -> None:
    """Raises a clear error when ``spec``'s row does not allow ``offload`` (``optimizer``:
    DeepSpeed's ``offload_optimizer``; ``optimizer+params``: ``offload_param``)."""
    if offload in spec.offloads:
        return
    key, text = _OFFLOAD_KEYS[offload], _stages_text(stages_allowing(offload))
    raise ValueError(
        f"zero_optimization.{key} needs stage {text} (what it moves to host memory is sharded "
        f"there), but zero_optimization.stage is {spec.stage}; set the stage to {text}, or "
        f"{key}.device to none."
    )
