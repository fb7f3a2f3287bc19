"""Deprecated alias of :mod:`jzero.replay`: stage 3's gathers now live in the replay package.

Kept so that ``jzero.gather.<name>`` as older code and notes cite it still imports; new code
imports from :mod:`jzero.replay`, where ``checkpoint_scans`` and ``checkpoint_policy`` are
``remat_scans`` and ``remat_save_policy`` ("checkpoint" now means Orbax only). Importing it
warns (``DeprecationWarning``) with the new import; it will be removed in a later release.
"""

import warnings

from jzero.replay import GATHERED as GATHERED
from jzero.replay import PARTITIONED as PARTITIONED
from jzero.replay import all_gather as all_gather
from jzero.replay import gathered as gathered
from jzero.replay import layer_dims as layer_dims
from jzero.replay import remat_save_policy as checkpoint_policy
from jzero.replay import remat_scans as checkpoint_scans
from jzero.replay import replay as replay

__all__ = [
    "GATHERED",
    "PARTITIONED",
    "all_gather",
    "checkpoint_policy",
    "checkpoint_scans",
    "gathered",
    "layer_dims",
    "replay",
]

warnings.warn(
    "jzero.gather is deprecated and will be removed in a later release: "
    "import from jzero.replay, where checkpoint_scans and checkpoint_policy are "
    "remat_scans and remat_save_policy.",
    DeprecationWarning,
    stacklevel=2,
)
