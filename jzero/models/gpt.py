"""Deprecated alias of :mod:`jzero.demo.gpt`, where the built-in GPT now lives.

Kept so that ``from jzero.models import gpt`` and ``jzero.models.gpt.<name>`` as older code and
notes cite them still import; new code imports from :mod:`jzero.demo.gpt`. Importing it warns
(``DeprecationWarning``) with the new import; it will be removed in a later release.
"""

import warnings

from jzero.demo.gpt import GPT as GPT
from jzero.demo.gpt import GPTConfig as GPTConfig
from jzero.demo.gpt import apply as apply
from jzero.demo.gpt import config_for as config_for
from jzero.demo.gpt import init_params as init_params
from jzero.demo.gpt import loss_fn as loss_fn
from jzero.demo.gpt import nnx_loss_fn as nnx_loss_fn
from jzero.demo.gpt import unrolled_loss_fn as unrolled_loss_fn
from jzero.demo.gpt import unstack_blocks as unstack_blocks

__all__ = [
    "GPT",
    "GPTConfig",
    "apply",
    "config_for",
    "init_params",
    "loss_fn",
    "nnx_loss_fn",
    "unrolled_loss_fn",
    "unstack_blocks",
]

warnings.warn(
    "jzero.models.gpt is deprecated and will be removed in a later release: "
    "import from jzero.demo.gpt.",
    DeprecationWarning,
    stacklevel=2,
)
