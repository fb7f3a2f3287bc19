"""DeepSpeed's ``sub_group_size``: which leaves form a group, the leafwise check, the update.

Import direction: imports nothing else of jzero's (pure pytree and optax logic); imported by
:mod:`jzero.plan`, :mod:`jzero.step` and :mod:`jzero.nvme`.

* :mod:`~jzero.groups.ownership`: which parameter leaves form a group, and which
  optimizer-state leaves each group owns.
* :mod:`~jzero.groups.update`: one group's optimizer update, and the update group by group.
* :mod:`~jzero.groups.leafwise`: the check that an optimizer's update is leafwise.
"""

from jzero.groups.leafwise import check_leafwise as check_leafwise
from jzero.groups.ownership import leaf_groups as leaf_groups
from jzero.groups.ownership import merge_single_leaf_groups as merge_single_leaf_groups
from jzero.groups.ownership import owned_state as owned_state
from jzero.groups.ownership import param_leaf_owner as param_leaf_owner
from jzero.groups.ownership import shared_state as shared_state
from jzero.groups.update import GroupUpdate as GroupUpdate
from jzero.groups.update import grouped_update as grouped_update
from jzero.groups.update import placeholder as placeholder
from jzero.groups.update import update_group as update_group
from jzero.groups.update import update_group_leaves as update_group_leaves

__all__ = [
    "check_leafwise",
    "grouped_update",
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
