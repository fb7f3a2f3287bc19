"""ZeRO's room: where each leaf is sharded (the leaf rule) and what the step does with it.

* :mod:`~jzero.parallel.zero.leaf_rule`: which dimension of a parameter leaf ZeRO shards, its
  padding or merged leading dimensions (:func:`pad_to`, :func:`unpad_to` as arrays), and why a
  leaf stays whole (:class:`LeafPlan`); the plan (:func:`jzero.plan.make_plan`) is made from
  it, with the stage table (:mod:`jzero.choices.stages`).
* :mod:`~jzero.parallel.zero.step`: ZeRO's part of the step: the loss with stage 3's gathers at
  their use (:func:`local_loss`; the most it gathers at once, :func:`largest_gathered`), stage
  2's per-layer reduce-scatters in the layer scan's backward (:func:`scattered_leaves`,
  :func:`stand_ins`, :func:`to_state_layout`), each stage's gradient reductions
  (:func:`reduce_grads`) and the ``shard_map`` over the data axes (:func:`sharded_grads`).

The names load on first use (:func:`jzero._util.lazy_exports`): the plan reads the leaf rule
while the step part reads the plan (as a type only), so importing one never runs the other.
"""

from typing import TYPE_CHECKING

from jzero._util import lazy_exports

if TYPE_CHECKING:
    from jzero.parallel.zero.leaf_rule import LeafPlan as LeafPlan
    from jzero.parallel.zero.leaf_rule import axis_entry as axis_entry
    from jzero.parallel.zero.leaf_rule import divisible_dim as divisible_dim
    from jzero.parallel.zero.leaf_rule import is_contiguous as is_contiguous
    from jzero.parallel.zero.leaf_rule import pad_to as pad_to
    from jzero.parallel.zero.leaf_rule import padded_size as padded_size
    from jzero.parallel.zero.leaf_rule import shard_dim as shard_dim
    from jzero.parallel.zero.leaf_rule import unpad_to as unpad_to
    from jzero.parallel.zero.step import largest_gathered as largest_gathered
    from jzero.parallel.zero.step import local_loss as local_loss
    from jzero.parallel.zero.step import reduce_grads as reduce_grads
    from jzero.parallel.zero.step import scattered_leaves as scattered_leaves
    from jzero.parallel.zero.step import sharded_grads as sharded_grads
    from jzero.parallel.zero.step import stand_ins as stand_ins
    from jzero.parallel.zero.step import to_state_layout as to_state_layout

__all__ = [
    "LeafPlan",
    "axis_entry",
    "divisible_dim",
    "is_contiguous",
    "largest_gathered",
    "local_loss",
    "pad_to",
    "padded_size",
    "reduce_grads",
    "scattered_leaves",
    "shard_dim",
    "sharded_grads",
    "stand_ins",
    "to_state_layout",
    "unpad_to",
]

__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "LeafPlan": "jzero.parallel.zero.leaf_rule.LeafPlan",
        "axis_entry": "jzero.parallel.zero.leaf_rule.axis_entry",
        "divisible_dim": "jzero.parallel.zero.leaf_rule.divisible_dim",
        "is_contiguous": "jzero.parallel.zero.leaf_rule.is_contiguous",
        "largest_gathered": "jzero.parallel.zero.step.largest_gathered",
        "pad_to": "jzero.parallel.zero.leaf_rule.pad_to",
        "padded_size": "jzero.parallel.zero.leaf_rule.padded_size",
        "shard_dim": "jzero.parallel.zero.leaf_rule.shard_dim",
        "unpad_to": "jzero.parallel.zero.leaf_rule.unpad_to",
        "local_loss": "jzero.parallel.zero.step.local_loss",
        "reduce_grads": "jzero.parallel.zero.step.reduce_grads",
        "scattered_leaves": "jzero.parallel.zero.step.scattered_leaves",
        "sharded_grads": "jzero.parallel.zero.step.sharded_grads",
        "stand_ins": "jzero.parallel.zero.step.stand_ins",
        "to_state_layout": "jzero.parallel.zero.step.to_state_layout",
    },
)
