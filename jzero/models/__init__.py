"""Deprecated alias of :mod:`jzero.demo.gpt`: the built-in GPT moved into the demo package.

Kept so that ``jzero.models.<name>`` (and ``jzero.models.gpt``) as older code and notes cite it
still imports; new code imports from :mod:`jzero.demo.gpt` (or :mod:`jzero.demo`). Importing it
warns (``DeprecationWarning``) with the new import; it will be removed in a later release.
"""

import warnings

from jzero.demo.gpt import GPT as GPT
from jzero.demo.gpt import GPTConfig as GPTConfig
from jzero.demo.gpt import apply as apply
from jzero.demo.gpt import init_params as init_params
from jzero.demo.gpt import loss_fn as loss_fn
from jzero.demo.gpt import nnx_loss_fn as nnx_loss_fn

__all__ = ["GPT", "GPTConfig", "apply", "init_params", "loss_fn", "nnx_loss_fn"]

warnings.warn(
    "jzero.models is deprecated and will be removed in a later release: "
    "import from jzero.demo.gpt (or jzero.demo).",
    DeprecationWarning,
    stacklevel=2,
)
