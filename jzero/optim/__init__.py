"""DeepSpeed optimizer and LR-schedule names, mapped onto optax.

The package has eight parts:

* :mod:`~jzero.optim.lr_schedules`: DeepSpeed's LR schedules (its ``scheduler`` section) as
  jittable functions of the update count (``build_lr_schedule``, ``current_lr``).
* :mod:`~jzero.optim.transforms`: the update rules optax lacks, in DeepSpeed's / PyTorch's form.
* :mod:`~jzero.optim.builder`: a config's ``optimizer`` and ``scheduler`` sections to one optax
  transformation.
* :mod:`~jzero.optim.low_precision`: ``low_precision_state``, any optimizer's state kept in
  bfloat16 (DeepSpeed's ``bf16.bf16_optimizer_states``).
* :mod:`~jzero.optim.master16`: ``float32_update`` and ``stochastic_round``, bfloat16 params that
  are their own master weights (DeepSpeed's ``bf16.bf16_master_weights_and_grads``).
* :mod:`~jzero.optim.muon_optimizer`: ``muon``, Muon with AdamW for the leaves that are no
  matrix, each matrix orthogonalised whole on the device that owns it inside jzero's step
  (``optimizer: {type: Muon}``; its rarely tuned settings in ``MuonOptions``);
  ``from_optax_muon``, the same for an ``optax.contrib.muon`` passed in code
  (``jzero.initialize`` applies it).
* :mod:`~jzero.optim.update_context`: what the step tells an optimizer while it traces the update
  (where each leaf rests); the step imports it, and no optimizer.
* :mod:`~jzero.optim.quantized`: ``quantized_adam_state``, Adam's moments as 8-bit blockwise
  codes (``optimizer.params.state_bits: 8``).

"Schedule" alone means the pipeline's (``pipeline.schedule``); here it is always the learning
rate's (the module ``lr_schedules``, its ``build_lr_schedule``). ``jzero.optim.muon`` is the
function; its module is ``muon_optimizer``.

Decisions:

* **DeepSpeed's update rules, not optax's look-alikes.** ``Adam``/``AdamW`` follow DeepSpeed's
  ``FusedAdam`` (AdamW unless ``adam_w_mode: false``, which adds L2 decay to the gradient like
  ``torch.optim.Adam``), ``Lamb`` follows ``FusedLamb`` (trust ratio clamped to
  [min_coeff, max_coeff], bias correction folded into the step size), ``SGD`` and ``Adagrad``
  follow ``torch.optim`` (first momentum step undamped; eps outside the square root), ``Lion``
  follows ``FusedLion`` (with sign(0) = 0, where the CUDA kernel moves by +lr). Where optax has
  the same rule (weight decay, the learning-rate scale) its transform is reused.
* **No gradient clipping here.** The engine clips from the gradient shards before the update.
* **The learning rate is an injected hyperparameter** (``optax.inject_hyperparams``), so the
  optimizer state carries the rate of the last update under ``hyperparams["learning_rate"]``;
  ``current_lr`` evaluates the schedule for any step.
* **DeepSpeed's step semantics.** DeepSpeed sets the rate once when the scheduler is built and
  calls ``scheduler.step()`` after each optimizer step, so update ``k`` (0-based) uses the
  schedule at ``last_batch_iteration = k - 1``, and update 0 the construction-time rate
  (``warmup_min_lr``, ``cycle_min_lr``, or 0 for ``WarmupCosineLR``). ``build_lr_schedule(cfg)(k)``
  is exactly the rate DeepSpeed uses for update ``k``.
* **OneCycle cycles momentum** (``cycle_momentum``, true by default in DeepSpeed) for the
  optimizers with betas (Adam, AdamW, Lamb, Lion): beta1 moves between ``cycle_max_mom`` and
  ``cycle_min_mom`` and beta2 is set to 0.99, as DeepSpeed does. SGD and Adagrad have no betas,
  so DeepSpeed (and jzero) leave their momentum alone.
* Lamb's trust ratio uses per-tensor norms: apply the optimizer to whole (logical) arrays, as
  ``jit`` with shardings does, not to local shards inside ``shard_map``.
"""

from jzero.optim.builder import build_optimizer as build_optimizer
from jzero.optim.low_precision import low_precision_state as low_precision_state
from jzero.optim.lr_schedules import build_lr_schedule as build_lr_schedule
from jzero.optim.lr_schedules import current_lr as current_lr
from jzero.optim.master16 import float32_update as float32_update
from jzero.optim.master16 import stochastic_round as stochastic_round
from jzero.optim.muon_optimizer import MuonOptions as MuonOptions
from jzero.optim.muon_optimizer import exchanges_once as exchanges_once
from jzero.optim.muon_optimizer import from_optax_muon as from_optax_muon
from jzero.optim.muon_optimizer import muon as muon
from jzero.optim.quantized import quantized_adam_state as quantized_adam_state
from jzero.optim.transforms import TorchAdagradState as TorchAdagradState
from jzero.optim.transforms import TorchSgdState as TorchSgdState
from jzero.optim.transforms import scale_by_fused_adam as scale_by_fused_adam
from jzero.optim.transforms import scale_by_fused_lamb as scale_by_fused_lamb
from jzero.optim.transforms import scale_by_fused_lion as scale_by_fused_lion
from jzero.optim.transforms import scale_by_torch_adagrad as scale_by_torch_adagrad
from jzero.optim.transforms import scale_by_torch_sgd as scale_by_torch_sgd

__all__ = [
    "MuonOptions",
    "build_lr_schedule",
    "build_optimizer",
    "current_lr",
    "exchanges_once",
    "float32_update",
    "from_optax_muon",
    "low_precision_state",
    "muon",
    "quantized_adam_state",
    "stochastic_round",
]
