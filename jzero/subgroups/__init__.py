"""DeepSpeed's ``sub_group_size``: which leaves form a group, the leafwise check, the update.

Import direction: imports nothing else of jzero's (pure pytree and optax logic); imported by
:mod:`jzero.plan`, :mod:`jzero.step` and :mod:`jzero.nvme`.

* :mod:`~jzero.subgroups.ownership`: which parameter leaves form a group, and which
  optimizer-state leaves each group owns.
* :mod:`~jzero.subgroups.update`: one group's optimizer update, and the update group by group.
* :mod:`~jzero.subgroups.leafwise`: the check that an optimizer's update is leafwise.

A "group" here is always a sub-group of ``sub_group_size``; the package is named ``subgroups``
because buckets, replica groups and process groups elsewhere are groups too.
"""

from jzero.subgroups.leafwise import check_leafwise as check_leafwise
from jzero.subgroups.ownership import leaf_groups as leaf_groups
from jzero.subgroups.ownership import merge_single_leaf_groups as merge_single_leaf_groups
from jzero.subgroups.ownership import owned_state as owned_state
from jzero.subgroups.ownership import param_leaf_owner as param_leaf_owner
from jzero.subgroups.ownership import shared_state as shared_state
from jzero.subgroups.update import GroupLeaves as GroupLeaves
from jzero.subgroups.update import GroupTransfers as GroupTransfers
from jzero.subgroups.update import GroupUpdate as GroupUpdate
from jzero.subgroups.update import grouped_update as grouped_update
from jzero.subgroups.update import placeholder as placeholder
from jzero.subgroups.update import update_group as update_group
from jzero.subgroups.update import update_group_leaves as update_group_leaves

__all__ = [
    "check_leafwise",
    "grouped_update",
    "GroupLeaves",
    "GroupTransfers",
    "GroupUpdate",
    "leaf_groups",
    "merge_single_leaf_groups",
    "owned_state",
    "param_leaf_owner",
    "placeholder",
    "shared_state",
    "update_group",
    "update_group_leaves",
]
