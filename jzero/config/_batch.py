"""DeepSpeed's batch arithmetic: train_batch_size = micro x accumulation x data-parallel size.

Decisions:

* Any two of the three determine the third; with only one, accumulation defaults to 1 and a
  lone ``train_batch_size`` gives micro = train_batch_size / dp, as DeepSpeed does.
* The data-parallel size is the size of the mesh's ``data`` axis only: other mesh axes hold the
  same batch rows, so they do not multiply the batch.
* A mismatch names all three values, the rule, and the nearest value that fits.
"""

from __future__ import annotations

from jzero.config._common import ConfigError
from jzero.config._schema import Config

__all__ = ["resolve_batch_sizes"]


def _nearest_multiple(value: int, base: int) -> int:
    return max(base, round(value / base) * base)


def batch_from_first_batch(cfg: Config) -> bool:
    """Whether the batch sizes are left to the first batch: neither ``train_batch_size`` nor
    ``train_micro_batch_size_per_gpu`` is set, whether written ``"auto"`` (Hugging Face's
    templates, whose TrainingArguments know the batch) or left out (Hugging Face's own
    ``ds_config_zero3.json``, which the Trainer and Accelerate fill in). ``jzero.initialize``
    then takes the global batch from the leading dimension of the first batch given to
    ``train_step``; ``jzero train``, which builds its data from the batch size, refuses."""
    return cfg.train_batch_size is None and cfg.train_micro_batch_size_per_gpu is None


def resolve_batch_sizes(cfg: Config, data_parallel_size: int) -> tuple[int, int, int]:
    """Resolves DeepSpeed's batch rule: train_batch_size = micro x accumulation x dp.

    Any two of the three determine the third. With only one: accumulation defaults to 1, and
    only ``train_batch_size`` gives micro = train_batch_size / dp (DeepSpeed's behaviour).

    Args:
      cfg: the config.
      data_parallel_size: the size of the data axis (devices holding distinct batches).

    Returns:
      (train_batch_size, train_micro_batch_size_per_gpu, gradient_accumulation_steps).

    Raises:
      ConfigError: when nothing is set, or the values do not fit together.
    """
    tbs, micro, accum = (
        cfg.train_batch_size,
        cfg.train_micro_batch_size_per_gpu,
        cfg.gradient_accumulation_steps,
    )
    dp = data_parallel_size
    written_auto = [
        k for k in ("train_batch_size", "train_micro_batch_size_per_gpu") if k in cfg.auto
    ]
    if tbs is None and micro is None and written_auto:
        raise ConfigError(
            f'{" and ".join(written_auto)} {"is" if len(written_auto) == 1 else "are"} "auto", '
            "but jzero has no batch size in the code to take them from (Hugging Face fills them "
            "from its TrainingArguments); set train_micro_batch_size_per_gpu (the batch per "
            "device, e.g. --set train_micro_batch_size_per_gpu=8) or train_batch_size (the "
            "global batch)."
        )
    if tbs is None and micro is None:
        raise ConfigError(
            "No batch size is set; set train_micro_batch_size_per_gpu (the batch per device) "
            "or train_batch_size (the global batch), optionally with gradient_accumulation_steps."
        )

    def show(key: str, value: int | None, unset: str) -> str:
        if value is not None:
            return f"{key}={value}"
        written = f"{key}=auto" if key in cfg.auto else f"{key} not set"
        return f"{written} ({unset})"

    def mismatch(detail: str, fix: str) -> ConfigError:
        steps = "derived" if micro is not None else "1, DeepSpeed's default"
        return ConfigError(
            f"The batch sizes do not fit together: {show('train_batch_size', tbs, 'derived')}, "
            f"{show('train_micro_batch_size_per_gpu', micro, 'derived')}, "
            f"{show('gradient_accumulation_steps', accum, steps)}, with a data-parallel size "
            f"of {dp}. "
            "DeepSpeed's rule is train_batch_size = train_micro_batch_size_per_gpu x "
            f"gradient_accumulation_steps x data-parallel size, {detail}. {fix}"
        )

    if tbs is None:
        steps = 1 if accum is None else accum  # DeepSpeed's default
        return micro * steps * dp, micro, steps
    if micro is None:
        steps = 1 if accum is None else accum  # DeepSpeed's default
        if tbs % (steps * dp):
            raise mismatch(
                f"but {tbs} is not divisible by {steps} x {dp} = {steps * dp}",
                f"Fix: set train_batch_size to a multiple of {steps * dp} (e.g. "
                f"{_nearest_multiple(tbs, steps * dp)}), or change gradient_accumulation_steps.",
            )
        return tbs, tbs // (steps * dp), steps
    if accum is None:
        if tbs % (micro * dp):
            raise mismatch(
                f"but {tbs} is not divisible by {micro} x {dp} = {micro * dp}",
                f"Fix: set train_batch_size to a multiple of {micro * dp} (e.g. "
                f"{_nearest_multiple(tbs, micro * dp)}), or change train_micro_batch_size_per_gpu.",
            )
        return tbs, micro, tbs // (micro * dp)
    if tbs != micro * accum * dp:
        raise mismatch(
            f"but {micro} x {accum} x {dp} = {micro * accum * dp}",
            f"Fix: set train_batch_size to {micro * accum * dp}, or set one of the three to "
            '"auto" (or remove it) and jzero derives it.',
        )
    return tbs, micro, accum
