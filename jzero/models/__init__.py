"""Built-in models: the byte-level GPT in a functional (pytree) and a Flax NNX form."""

from jzero.models.gpt import GPT as GPT
from jzero.models.gpt import GPTConfig as GPTConfig
from jzero.models.gpt import apply as apply
from jzero.models.gpt import init_params as init_params
from jzero.models.gpt import loss_fn as loss_fn
from jzero.models.gpt import nnx_loss_fn as nnx_loss_fn

__all__ = ["GPT", "GPTConfig", "apply", "init_params", "loss_fn", "nnx_loss_fn"]
