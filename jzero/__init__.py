"""jzero: DeepSpeed's ZeRO stages, host offload and sharded checkpoints for JAX.

The public surface fits on one screen:

* :func:`initialize` builds an :class:`Engine` from params (or a function of a key that
  creates them), a loss function, an optax optimizer (or the config's) and a DeepSpeed-style
  config; :class:`InitOptions` holds its rarer settings (mesh, specs, weights to load).
* The pure pieces for users who run their own loop: :func:`make_mesh`, :func:`make_plan`,
  :func:`make_train_step`, :func:`make_eval_step`, :func:`init_train_state`,
  :class:`TrainState`, :class:`Precision`, :func:`load_config`; the stage table
  (:data:`STAGES` of :class:`StageSpec`).
* :func:`estimate` (the closed-form memory planner) and :func:`init_distributed` (several
  processes; DeepSpeed's name).
* Sequence and context parallelism for a user's model: :func:`sequence_chunk` and
  :func:`sequence_positions` (this device's tokens and their places),
  :func:`sequence_parallel_attention` (Ulysses) and :func:`context_parallel_attention` (ring
  attention, with Ulysses beside it).
* :mod:`moe` (:mod:`jzero.parallel.expert`): a mixture-of-experts layer for a user's model,
  its experts split over the ``expert`` axis (``expert_parallel.autoep_size``).

The names load on first use (:func:`jzero._util.lazy_exports`): ``import jzero`` imports no
JAX, Flax, Optax or Orbax; reading a name imports what it needs.
"""

from typing import TYPE_CHECKING

from jzero._util import lazy_exports

if TYPE_CHECKING:
    from jzero import ops as ops
    from jzero.config import Config as Config
    from jzero.config import ConfigError as ConfigError
    from jzero.config import load_config as load_config
    from jzero.distributed import init_distributed as init_distributed
    from jzero.distributed import make_mesh as make_mesh
    from jzero.engine import Engine as Engine
    from jzero.engine import InitOptions as InitOptions
    from jzero.engine import initialize as initialize
    from jzero.memory import estimate as estimate
    from jzero.ops import blockwise_attention as blockwise_attention
    from jzero.ops import tiled_cross_entropy as tiled_cross_entropy
    from jzero.ops import tiled_mlp as tiled_mlp
    from jzero.parallel import context_parallel_attention as context_parallel_attention
    from jzero.parallel import expert as moe
    from jzero.parallel import sequence_chunk as sequence_chunk
    from jzero.parallel import sequence_offset as sequence_offset
    from jzero.parallel import sequence_parallel_attention as sequence_parallel_attention
    from jzero.parallel import sequence_positions as sequence_positions
    from jzero.plan import STAGES as STAGES
    from jzero.plan import Plan as Plan
    from jzero.plan import Precision as Precision
    from jzero.plan import StageSpec as StageSpec
    from jzero.plan import make_plan as make_plan
    from jzero.step import TrainState as TrainState
    from jzero.step import init_train_state as init_train_state
    from jzero.step import make_eval_step as make_eval_step
    from jzero.step import make_train_step as make_train_step
    from jzero.train import fit as fit
    from jzero.train import verify as verify

__all__ = [
    "blockwise_attention",
    "Config",
    "ConfigError",
    "context_parallel_attention",
    "Engine",
    "estimate",
    "fit",
    "init_distributed",
    "init_train_state",
    "initialize",
    "InitOptions",
    "load_config",
    "make_eval_step",
    "make_mesh",
    "make_plan",
    "make_train_step",
    "moe",
    "ops",
    "Plan",
    "Precision",
    "sequence_chunk",
    "sequence_offset",
    "sequence_parallel_attention",
    "sequence_positions",
    "STAGES",
    "StageSpec",
    "tiled_cross_entropy",
    "tiled_mlp",
    "TrainState",
    "verify",
]

__version__ = "0.1.0"

__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "ops": "jzero.ops",
        "Config": "jzero.config.Config",
        "ConfigError": "jzero.config.ConfigError",
        "load_config": "jzero.config.load_config",
        "init_distributed": "jzero.distributed.init_distributed",
        "make_mesh": "jzero.distributed.make_mesh",
        "Engine": "jzero.engine.Engine",
        "InitOptions": "jzero.engine.InitOptions",
        "initialize": "jzero.engine.initialize",
        "estimate": "jzero.memory.estimate",
        "blockwise_attention": "jzero.ops.blockwise_attention",
        "tiled_cross_entropy": "jzero.ops.tiled_cross_entropy",
        "tiled_mlp": "jzero.ops.tiled_mlp",
        "context_parallel_attention": "jzero.parallel.context_parallel_attention",
        "moe": "jzero.parallel.expert",
        "sequence_chunk": "jzero.parallel.sequence_chunk",
        "sequence_offset": "jzero.parallel.sequence_offset",
        "sequence_parallel_attention": "jzero.parallel.sequence_parallel_attention",
        "sequence_positions": "jzero.parallel.sequence_positions",
        "STAGES": "jzero.plan.STAGES",
        "Plan": "jzero.plan.Plan",
        "Precision": "jzero.plan.Precision",
        "StageSpec": "jzero.plan.StageSpec",
        "make_plan": "jzero.plan.make_plan",
        "TrainState": "jzero.step.TrainState",
        "init_train_state": "jzero.step.init_train_state",
        "make_eval_step": "jzero.step.make_eval_step",
        "make_train_step": "jzero.step.make_train_step",
        "fit": "jzero.train.fit",
        "verify": "jzero.train.verify",
    },
)
