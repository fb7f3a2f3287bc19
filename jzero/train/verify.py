"""``jzero verify CONFIG``: does my layout change my training? The config's model trained a few
steps at the config's layout and at plain data parallelism (stage 0, every device on ``data``),
from the same weights on the same global batches, in float64, compared step by step.

Decisions:

* **The same run twice.** Both sides build the config's model (the built-in GPT, as float64
  parameters of its functional form, or a user's entry point under ``jax_enable_x64``) from
  the config's seed, read the same global batches from the ``data`` section, and train the same
  global batch size (the reference's accumulation follows from its own data-parallel size).
  ``--against OTHER`` compares with another config instead of plain data parallelism.
* **The bound is the dtype's**: a step differs when its loss or gradient norm differs by more
  than ``10^6`` units of rounding of the parameters' dtype, relative (``2.2e-10`` in float64,
  where layouts agree to about ``1e-13``; ``0.12`` in float32, so float32 models are checked for
  gross differences only), and the parameters at the end by more than that relative to their
  largest entry. The first differing step is named (a loss differs one step after the update
  that made it differ).
* Nothing is written: no checkpoint, no log folder (the config's ``checkpoint`` section is
  off for both sides).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from jzero.config import load_config
from jzero.train import command

__all__ = ["Verdict", "verify"]

ULPS = 1e6  # the bound, in units of rounding of the parameters' dtype

# The reference: plain data parallelism at stage 0, the config's batch kept.
_PLAIN = (
    "zero_optimization={stage: 0}",
    "mesh={data: -1}",
    "tensor_parallel={autotp_size: 1}",
    "sequence_parallel_size=1",
    "pipeline={stages: 1}",
    "expert_parallel={autoep_size: 1}",
    "train_micro_batch_size_per_gpu=null",
    "gradient_accumulation_steps=null",
)
_QUIET = ("checkpoint.directory=null", "train.eval_interval=0")


@dataclasses.dataclass(frozen=True)
class Verdict:
    """What :func:`verify` found.

    Attributes:
      passed: every step within the bound.
      rows: per step ``(step, loss, reference loss, grad norm, reference grad norm)``.
      max_param_diff: the largest parameter difference at the end, relative to the largest
        parameter.
      bound: the relative bound (``ULPS`` units of rounding of ``dtype``).
      dtype: the parameters' dtype.
      first_difference: the first step whose loss or gradient norm differs (``None``: none),
        or ``0`` for the initial weights.
      layouts: the two sides' layouts, as their plans describe them.
      config_differences: the dotted config keys whose values differ between the two sides
        (beside the layout's own, with ``--against``).
    """

    passed: bool
    rows: tuple[tuple[int, float, float, float, float], ...]
    max_param_diff: float
    bound: float
    dtype: str
    first_difference: int | None
    layouts: tuple[str, str]
    config_differences: tuple[str, ...] = ()

    def table(self) -> str:
        """The per-step comparison and the verdict, as ``jzero verify`` prints them."""
        lines = [
            f"config:    {self.layouts[0]}",
            f"reference: {self.layouts[1]}",
            *(
                [f"the configs differ in: {', '.join(self.config_differences)}"]
                if self.config_differences
                else []
            ),
            f"{'step':>4}  {'loss':>22}  {'reference':>22}  {'rel. diff':>9}  "
            f"{'grad norm diff':>14}",
        ]
        for step, loss, ref, norm, ref_norm in self.rows:
            rel = abs(loss - ref) / max(abs(ref), 1e-300)
            gn = abs(norm - ref_norm) / max(abs(ref_norm), 1e-300)
            lines.append(f"{step:>4}  {loss:>22.16g}  {ref:>22.16g}  {rel:>9.2e}  {gn:>14.2e}")
        lines.append(
            f"parameters after step {len(self.rows)}: largest difference {self.max_param_diff:.2e} "
            f"of the largest parameter; bound {self.bound:.1e} ({ULPS:.0e} units of {self.dtype} "
            "rounding)"
        )
        if self.passed:
            lines.append("verdict: the same training (every step within the bound)")
        elif self.first_difference == 0:
            lines.append("verdict: DIFFERENT: the initial weights differ")
        else:
            lines.append(f"verdict: DIFFERENT from step {self.first_difference} on")
        return "\n".join(lines)


def _side(config: Any, overrides: Sequence[str]) -> tuple[Any, dict[str, Any], int, int | None]:
    cfg = load_config(config, overrides=[*overrides, *_QUIET])
    args, seq_len, vocab = command.model_args(cfg, float64=True)
    return cfg, args, seq_len, vocab


def verify(
    config: Any,
    *,
    against: Any = None,
    model: str | None = None,
    steps: int = 5,
    overrides: Sequence[str] = (),
) -> Verdict:
    """Trains the config's model ``steps`` steps at its layout and at plain data parallelism
    (or ``against``'s), in float64, and compares them (see the module's decisions).

    Args:
      config: the config (a file, a mapping or a ``Config``).
      against: another config to compare with; ``None``: plain data parallelism at stage 0.
      model: a model entry point (``--model``); else the config's ``model.entry`` or the GPT.
      steps: the steps each side trains.
      overrides: ``"dotted.key=value"`` strings applied to both sides.
    """
    given = [*overrides, *([f"model.entry={model}"] if model else [])]
    with jax.enable_x64(True):
        cfg, args, seq_len, vocab = _side(config, given)
        engine = command.build_engine(cfg, args, seq_len)
        batch = engine.train_batch_size
        ref_given = [*given, *(() if against is not None else _PLAIN), f"train_batch_size={batch}"]
        ref_cfg, ref_args, _, _ = _side(config if against is None else against, ref_given)
        reference = command.build_engine(ref_cfg, ref_args, seq_len)
        data = command.data_loaders(engine, seq_len, vocab).train
        batches = [data.next() for _ in range(steps)]
        dtype = np.result_type(*[np.dtype(x.dtype) for x in jax.tree.leaves(engine.params)])
        bound = ULPS * float(np.finfo(dtype).eps)
        first = None if _close(engine.params, reference.params, bound) else 0
        rows = []
        for step, b in enumerate(batches, 1):
            m, r = engine.train_step(b), reference.train_step(b)
            row = (
                step,
                *(float(v) for v in (m["loss"], r["loss"], m["grad_norm"], r["grad_norm"])),
            )
            rows.append(row)
            if first is None and not (
                _near(row[1], row[2], bound) and _near(row[3], row[4], bound)
            ):
                first = step
        diff = _param_diff(engine.params, reference.params)
        layouts = (_layout(engine), _layout(reference))
        engine.close()
        reference.close()
    passed = first is None and diff <= bound
    if first is None and not passed:
        first = steps
    differs = _differences(cfg.to_dict(), ref_cfg.to_dict()) if against is not None else ()
    return Verdict(passed, tuple(rows), diff, bound, dtype.name, first, layouts, differs)


def _flat(value: Any, path: str = "") -> dict[str, Any]:
    if isinstance(value, dict) and value:
        out: dict[str, Any] = {}
        for k, v in value.items():
            out.update(_flat(v, f"{path}.{k}" if path else str(k)))
        return out
    return {path: value}


def _differences(a: dict[str, Any], b: dict[str, Any]) -> tuple[str, ...]:
    fa, fb = _flat(a), _flat(b)
    return tuple(k for k in sorted(set(fa) | set(fb)) if fa.get(k) != fb.get(k))


def _near(a: float, b: float, bound: float) -> bool:
    return abs(a - b) <= bound * max(abs(b), 1e-300)


def _param_diff(a: Any, b: Any) -> float:
    la = [np.asarray(x, np.float64) for x in jax.tree.leaves(a)]
    lb = [np.asarray(x, np.float64) for x in jax.tree.leaves(b)]
    scale = max(float(np.max(np.abs(x))) for x in lb) or 1.0
    return max(float(np.max(np.abs(x - y))) for x, y in zip(la, lb, strict=True)) / scale


def _close(a: Any, b: Any, bound: float) -> bool:
    return _param_diff(a, b) <= bound


def _layout(engine: Any) -> str:
    mesh = ", ".join(f"{k}={v}" for k, v in engine.mesh.shape.items())
    return (
        f"ZeRO stage {engine.plan.stage.stage} over {{{mesh}}}, batch {engine.train_batch_size} = "
        f"{engine.micro_batch_size} x {engine.accumulation_steps} x "
        f"{engine.plan.data_parallel_size}"
    )
