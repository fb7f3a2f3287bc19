"""Validation of ``zero_optimization`` across its keys: where the offloaded state may rest at
the configured stage, the NVMe tier, ``sub_group_size`` and hybrid sharding (MiCS, ZeRO++ hpZ).

Decisions:

* These rules run after the sections are built, from ``_validate``'s cross-field check and in
  its place in the order: the offload devices against the stage first (the stage table,
  ``stages.check_offload``, gives the message), then the NVMe tier, then ``sub_group_size``,
  then hybrid sharding. Which error a config with several faults gets is therefore unchanged.
* The NVMe tier holds the optimizer state whenever it holds the parameters, needs a
  ``nvme_path``, and holds all of the state (``ratio`` below 1 is refused there, as it is with
  no offload at all). ``compute`` belongs to ``offload_optimizer`` only, and ``host`` needs the
  state in host memory (``device: cpu``).
* Before them, ``resolve_zero`` reads what DeepSpeed reads only at stage 3 as DeepSpeed does
  below it: ``offload_param`` and ``zero_hpz_partition_size`` are ignored there (reset to off,
  listed as no-effect keys), not refused. ``sub_group_size: 0`` (DeepSpeed: every parameter a
  sub-group of its own) is read as 1, which groups the leaves the same way.
* ``sub_group_size`` left at its default says nothing; set without ``offload_optimizer`` it is
  accepted and listed as a no-effect key, not refused.
* hpZ excludes MiCS; the mesh the shard group implies is checked against the ``mesh`` section
  by ``Config.mesh_sizes``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jzero.choices import stages
from jzero.config._common import ConfigError
from jzero.config._schema import Config

__all__ = ["check_zero", "resolve_zero"]


def resolve_zero(cfg: Config, noted: list) -> Config:
    """``cfg`` with the ``zero_optimization`` keys DeepSpeed reads only at some stages, or
    reads in its own way, made what they mean at the configured stage.

    * ``offload_param`` at a stage that keeps parameters whole, and ``zero_hpz_partition_size``
      above 1 at a stage that does not shard them: DeepSpeed reads both at stage 3 only and
      ignores them below it. So does jzero: reset to off, listed in ``noted``.
    * ``sub_group_size: 0``: DeepSpeed makes each parameter a sub-group of its own. Groups of at
      most one element are the same (a leaf never splits), so it is read as 1.
    """
    zero = cfg.zero_optimization
    spec = stages.stage_spec(zero.stage)
    changes: dict[str, Any] = {}
    if zero.offload_param.device != "none" and "optimizer+params" not in spec.offloads:
        shown = " or ".join(map(str, stages.stages_allowing("optimizer+params")))
        noted.append(
            (
                "zero_optimization.offload_param",
                f"it offloads the parameter shards of stage {shown}, and stage {zero.stage} "
                "keeps the parameters whole (DeepSpeed ignores it there too)",
            )
        )
        changes["offload_param"] = type(zero.offload_param)()
    if zero.zero_hpz_partition_size > 1 and not spec.shard_params:
        noted.append(
            (
                "zero_optimization.zero_hpz_partition_size",
                f"ZeRO++ hpZ partitions the sharded parameters, and stage {zero.stage} keeps "
                "them whole (DeepSpeed ignores it there too; mics_shard_size is hybrid "
                "sharding at any stage)",
            )
        )
        changes["zero_hpz_partition_size"] = 1
    if zero.sub_group_size == 0:
        changes["sub_group_size"] = 1
    if not changes:
        return cfg
    return dataclasses.replace(cfg, zero_optimization=dataclasses.replace(zero, **changes))


def check_zero(cfg: Config, noted: list) -> None:
    """The ``zero_optimization`` rules, in ``_validate``'s order; no-effect keys go to ``noted``."""
    zero = cfg.zero_optimization
    spec = stages.stage_spec(zero.stage)
    for key, offload in (("offload_optimizer", "optimizer"), ("offload_param", "optimizer+params")):
        if getattr(zero, key).device != "none":
            try:
                stages.check_offload(spec, offload)
            except ValueError as e:
                raise ConfigError(str(e)) from None
    _check_nvme(zero)
    if zero.sub_group_size != 1_000_000_000 and zero.offload_optimizer.device == "none":
        noted.append(
            (
                "zero_optimization.sub_group_size",
                "it streams the optimizer step only with offload_optimizer (cpu or nvme)",
            )
        )
    _check_hybrid(cfg)


def _check_nvme(zero: Any) -> None:
    """The NVMe tier: the optimizer state there whenever the parameters are, with a path, and
    all of it."""
    opt, par = zero.offload_optimizer, zero.offload_param
    if par.device == "nvme" and opt.device != "nvme":
        raise ConfigError(
            "zero_optimization.offload_param.device is nvme, but offload_optimizer.device is "
            f"{opt.device}: jzero runs the parameters' files through the NVMe tier's step, "
            "which keeps the optimizer state on NVMe too. Set offload_optimizer: {device: nvme, "
            "nvme_path: DIR}, or offload_param.device to cpu."
        )
    if par.compute != "device":
        raise ConfigError(
            f"zero_optimization.offload_param.compute: {par.compute!r} is not allowed; compute "
            "says where the offloaded optimizer update runs, so it belongs under "
            "offload_optimizer. Remove it from offload_param."
        )
    if opt.compute == "host" and opt.device != "cpu":
        raise ConfigError(
            "zero_optimization.offload_optimizer.compute: 'host' updates the optimizer state "
            f"where it rests in host memory, but offload_optimizer.device is {opt.device}; set "
            "device: cpu, or remove compute."
        )
    if opt.device == "nvme" and not opt.nvme_path:
        raise ConfigError(
            "zero_optimization.offload_optimizer.device is nvme but nvme_path is not set; set "
            "offload_optimizer.nvme_path to a directory on a fast local disk."
        )
    if opt.device == "nvme" and opt.ratio < 1.0:
        raise ConfigError(
            f"zero_optimization.offload_optimizer.ratio: {opt.ratio} applies to host memory "
            "(device: cpu); the NVMe tier keeps all of the optimizer state on disk. Set ratio: "
            "1.0, or device: cpu."
        )
    if opt.device == "none" and opt.ratio < 1.0:
        raise ConfigError(
            f"zero_optimization.offload_optimizer.ratio: {opt.ratio} is the fraction of the "
            "state offloaded, but offload_optimizer.device is none; set device: cpu."
        )


def _check_hybrid(cfg: Config) -> None:
    """MiCS and ZeRO++ hpZ (at stage 3, see ``resolve_zero``): not both, and a mesh that
    agrees."""
    zero = cfg.zero_optimization
    hpz, mics = zero.zero_hpz_partition_size, zero.mics_shard_size
    if hpz > 1 and mics > 0:
        raise ConfigError(
            f"zero_optimization.zero_hpz_partition_size: {hpz} and mics_shard_size: {mics} are "
            "both set, but they are two ways to lay out the shards across hosts; keep one."
        )
    cfg.mesh_sizes()  # the shard group agrees with the mesh section
