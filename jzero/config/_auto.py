"""``"auto"``: the values a DeepSpeed integration leaves to the code, resolved at initialize.

Hugging Face Transformers and Accelerate write ``"auto"`` into their DeepSpeed templates and
fill each one from the training arguments or the model. jzero's code side is what
``jzero.initialize`` receives: the parameters and the optax optimizer. ``resolve_auto`` is
called there, once, before anything is built from the config.

Decisions:

* Loading already put each ``auto`` key's load-time value in place and recorded the key in
  ``Config.auto`` (the ``auto`` field metadata, see ``jzero.config._sections``). Most keys need
  nothing from the code, so that value stands: ``gradient_clipping`` 1.0 (DeepSpeed's
  default), ``stage3_param_persistence_threshold`` 1e5, ``stage3_max_live_parameters`` 1e9,
  ``reduce_bucket_size``/``allgather_bucket_size`` their defaults (5e8: with ``overlap_comm``,
  one bucket for any model under 500M parameters),
  ``stage3_gather_16bit_weights_on_model_save`` false, and ``stage3_prefetch_bucket_size`` /
  ``stage3_max_reuse_distance`` *not set*: jzero's "no prefetch, no reuse", about one layer
  gathered at a time. Hugging Face would derive the bucket sizes and the persistence threshold
  from ``hidden_size`` (hidden², 0.9 hidden², 10 hidden); jzero sees only leaf shapes, where
  the hidden size is a guess, and its unset prefetch and reuse are its bounded-memory choice.
* ``bf16.enabled`` / ``fp16.enabled``: true when every floating-point parameter is bfloat16
  (float16), unless the other precision is enabled; otherwise false. Mixed precision then
  keeps float32 master weights of those parameters, as Hugging Face's ``--bf16`` does. What
  needs ``bf16.enabled`` (``bf16_optimizer_states``, ``bf16_master_weights_and_grads``) is
  checked then, by the same rule as at load (``check_bf16``).
* The three batch sizes stay ``None`` in the config (``resolve_batch_sizes`` derives them);
  the log line shows the values they get. When neither the global nor the micro batch is set
  (all ``auto``), the first batch given to ``train_step`` decides
  (:func:`~jzero.config._batch.batch_from_first_batch`).
* With an optax optimizer passed, the config's ``optimizer`` and ``scheduler`` sections are
  not used (their ``auto`` values come from that optimizer): they are dropped, with one log
  line. Without one, an ``auto`` there is one ``ConfigError`` naming every such key.
* JAX is imported where the parameters' dtypes are read, not with the module: loading a
  config (``jzero.load_config``) needs no JAX.
* One ``INFO`` line on the ``jzero`` logger lists what each ``auto`` resolved to; the returned
  config has ``auto`` empty, so it (and a checkpoint's copy) holds only concrete values.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from jzero.config._batch import batch_from_first_batch, resolve_batch_sizes
from jzero.config._common import ConfigError, show
from jzero.config._optimizers import auto_keys
from jzero.config._schema import Config
from jzero.config._validate import check_bf16

__all__ = ["LAYOUT_KEYS", "resolve_auto"]

logger = logging.getLogger(__name__)

_BATCH = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
LAYOUT_KEYS = (
    "tensor_parallel.autotp_size",
    "sequence_parallel_size",
    "context_parallel_size",
    "pipeline.stages",
    "expert_parallel.autoep_size",
)
"""The parallel sizes ``"auto"`` leaves to the compiled step (:mod:`jzero.engine.auto_layout`)."""
_PRECISION = {
    "bf16.enabled": ("bf16", "fp16", "bfloat16"),
    "fp16.enabled": ("fp16", "bf16", "float16"),
}


def _float_dtypes(params: Any) -> set[str]:
    """The names of the parameters' floating-point dtypes (``{"bfloat16"}``)."""
    import jax  # the parameters are JAX's: their caller has it loaded
    import jax.numpy as jnp

    leaves = jax.tree.leaves(params)
    return {jnp.dtype(x.dtype).name for x in leaves if jnp.issubdtype(x.dtype, jnp.floating)}


def _get(cfg: Config, path: str) -> Any:
    value: Any = cfg
    for part in path.split("."):
        value = getattr(value, part)
    return value


def _replace(cfg: Any, path: str, value: Any) -> Any:
    head, _, rest = path.partition(".")
    if not rest:
        return dataclasses.replace(cfg, **{head: value})
    return dataclasses.replace(cfg, **{head: _replace(getattr(cfg, head), rest, value)})


def resolve_auto(
    cfg: Config, params: Any, *, optimizer_given: bool, data_parallel_size: int
) -> Config:
    """Resolves every ``"auto"`` of ``cfg`` from what ``jzero.initialize`` was given.

    Args:
      cfg: the loaded config.
      params: the parameters (arrays or ``jax.ShapeDtypeStruct``), for their dtypes.
      optimizer_given: whether an optax optimizer was passed to ``jzero.initialize``.
      data_parallel_size: the size of the mesh's data axis, for the batch sizes in the log.

    Returns:
      The config with concrete values and ``auto`` empty; without an optimizer given, the
      same ``optimizer``/``scheduler`` sections, else none.

    Raises:
      ConfigError: an ``"auto"`` in the optimizer or scheduler section with no optimizer given.
    """
    sections = [
        (name, section)
        for name in ("optimizer", "scheduler")
        if (section := getattr(cfg, name)) is not None
    ]
    opt_autos = auto_keys(cfg.optimizer, "optimizer") + auto_keys(cfg.scheduler, "scheduler")
    if opt_autos and not optimizer_given:
        raise ConfigError(
            f'{", ".join(opt_autos)} {"is" if len(opt_autos) == 1 else "are"} "auto", which '
            "takes the value from the optax optimizer passed to jzero.initialize, and none was "
            "passed. Pass optimizer=optax.adamw(...) (the config's optimizer and scheduler "
            "sections are then not used), or write the values in the config."
        )
    if optimizer_given and sections:
        shown = " and ".join(f"{name} ({section.type})" for name, section in sections)
        logger.info(
            "jzero: the config's %s section%s not used: the optax optimizer passed to "
            "jzero.initialize is.",
            shown,
            "s are" if len(sections) > 1 else " is",
        )
        cfg = dataclasses.replace(cfg, optimizer=None, scheduler=None)
    if not cfg.auto and not opt_autos:
        return cfg
    dtypes = _float_dtypes(params)
    for path in cfg.auto:
        if path in _PRECISION:
            own, other, dtype = _PRECISION[path]
            other_on = getattr(cfg, other).enabled and f"{other}.enabled" not in cfg.auto
            cfg = _replace(cfg, path, dtypes == {dtype} and not other_on)
    check_bf16(cfg, auto_resolved=True)  # what waited for bf16.enabled
    resolved = []
    layout = any(key in cfg.auto for key in LAYOUT_KEYS)
    if layout:  # the batch arithmetic follows the layout chosen at the first batch
        sizes = dict.fromkeys(_BATCH, "with the layout, at the first batch")
    elif batch_from_first_batch(cfg):
        sizes = dict.fromkeys(_BATCH, "from the first batch")
    elif any(key in cfg.auto for key in _BATCH):
        sizes = dict(zip(_BATCH, resolve_batch_sizes(cfg, data_parallel_size), strict=True))
    for path in cfg.auto:
        if path in LAYOUT_KEYS:
            value = "from the compiled step, at the first batch"
        elif path in _BATCH:
            value = sizes[path] if isinstance(sizes[path], str) else show(sizes[path])
        elif path in _PRECISION:
            shown = ", ".join(sorted(dtypes)) or "none"
            value = f"{show(_get(cfg, path))} (floating-point params: {shown})"
        else:
            value = _get(cfg, path)
            value = "not set" if value is None else show(value)
        resolved.append(f"{path}={value}")
    resolved += [f"{path}=from the optax optimizer" for path in opt_autos]
    logger.info('jzero: "auto" resolved: %s', ", ".join(resolved))
    return dataclasses.replace(cfg, auto=())
