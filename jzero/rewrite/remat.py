"""Activation checkpointing: which values of each stacked layer are kept for the backward pass.

DeepSpeed's ``activation_checkpointing`` checkpoints the modules a model wraps in
``deepspeed.checkpointing.checkpoint``. jzero needs no model change: it rematerialises each
layer of the loss (the body of every ``jax.lax.scan``, and each layer of a Python loop over
layers), at every stage. The loss is traced once and the trace replayed with each layer
re-emitted under ``jax.checkpoint(policy=...)`` (:mod:`jzero.rewrite.gather` holds the replayer;
stage 3 uses the same replay to gather one layer at a time). Each layer then keeps only what its
policy saves, plus its input; the rest is recomputed in the backward pass.

The policies, one table (:data:`POLICIES`, in :mod:`jzero.choices.remat` with how a value is
read, so the config validates against it), set as ``activation_checkpointing.policy``:

=================  ==================================================  ===================
policy             kept for the backward pass, per layer               JAX policy
=================  ==================================================  ===================
``none``           everything (no rematerialisation)                   (no ``checkpoint``)
``full``           only the layer's input; all else is recomputed      ``nothing_saveable``
``dots``           matmul/convolution outputs                          ``dots_saveable``
``dots_no_batch``  matmul outputs without batch dimensions (weights    ``dots_with_no_batch_
                   times activations, not attention scores)            dims_saveable``
``names:a,b``      the values the model tagged with                    ``save_only_these_
                   ``jax.ad_checkpoint.checkpoint_name(x, "a")``       names``
=================  ==================================================  ===================

Decisions:

* **No section, no checkpointing.** Without an ``activation_checkpointing`` section (policy
  ``None``), stages 0-2 rematerialise nothing and stage 3 keeps its own rule for the scans
  whose weights it gathers: ``dots_no_batch`` (:data:`jzero.rewrite.gather.remat_save_policy`).
  With the section and no ``policy`` key the policy is ``full``: a DeepSpeed user who adds the
  section expects checkpointing, and DeepSpeed checkpoints keep only each layer's input.
* **A layer is a scan body, or a layer of a Python loop.** Stacked layers under
  ``jax.lax.scan`` have their body checkpointed. A model written as a Python loop over layers
  (Linen submodules, an ``nnx.List``, a list of pytrees, slices ``p["w"][i]`` of a stacked
  leaf) has its layers found in the trace: the parameters' paths name the layers
  (:func:`jzero.rewrite.trace.layer_keys`: the path up to its first numbered part, such as
  ``layers_3`` or ``blocks/3``), and a layer runs from the first eqn that applies one of its
  parameters to an activation up to the next layer's first (the last layer: to its last use).
  Each such layer is checkpointed with the policy; what lies before the first layer (the
  embedding) and after the last (the head, the loss) is not. ``jax.checkpoint`` alone is not
  enough there on CPU (XLA's CSE merges the recomputation back into the forward pass), so the
  layer's saved values are tied to its cotangent (:func:`jzero.rewrite.trace.remat_layer`):
  ``benchmarks/stage3_layers.py``, 16 residual MLP layers at stage 0: 5.56 MiB of
  temporaries without a policy and 4.13 MiB with ``full``. Scans inside a scan body, or
  inside the model's own ``jax.checkpoint``, ``cond`` or custom derivative, are left as the
  model wrote them.
* **Stage 3 never saves a gathered weight, whatever the policy.** The all-gather of each
  layer's weights sits inside the checkpointed body. ``full``, ``dots`` and
  ``dots_no_batch`` never save an all-gather output (an all-gather is not a dot), so the
  backward pass gathers each layer again (ZeRO-3's 3x volume, one layer's weights live); only
  a matmul of two weights (a low-rank product) would be kept by ``dots``. ``none`` at stage 3
  would save the gathered weights, so there it means "keep every activation, recompute only
  the weights": every value of the body that depends on the layer's input (the scan carry) is
  tagged with ``checkpoint_name`` and saved; weights and values computed from weights alone
  are recomputed (re-gathered). JAX's ``save_anything_except_these_names`` cannot do this: in
  JAX 0.10.2 it saves everything.
  ``names:`` at stage 3 saves exactly the tagged values, so a tag on a weight would keep it.
* **``partition_activations: true``** (DeepSpeed's, for model parallelism): on a mesh with
  axes besides ``data`` (``{data: 4, model: 2}``), each layer's saved input is split over
  them and gathered back before the layer is recomputed (:class:`jzero.rewrite.trace.Partition`), so
  a model-parallel group keeps one copy of it instead of one per device. A scan body saves
  the split carry by name; a Python loop's layer takes its VJP at the split input. Without
  such an axis it has no effect (the config warning lists it).
* **``cpu_checkpointing: true``** keeps what the policy saves in ``pinned_host`` memory instead
  of device memory (``jax.ad_checkpoint.Offloadable``: moved to the host in the forward pass
  and back in the backward pass), DeepSpeed's CPU checkpointing. With ``full`` that is each
  layer's input (tagged ``jzero_layer_input`` and offloaded); with ``dots``/``dots_no_batch``
  the matmul outputs and the layer's input; with ``names:`` the tagged values; with ``none``
  at stage 3 every activation of a gathered layer. With ``none`` at stages 0-2, or no policy,
  nothing is checkpointed, so there is nothing to offload (a config error).
  On CPU devices host and device memory are the same memory and ``memory_analysis()`` reports
  no host bytes: only a GPU/TPU run shows the device-memory saving.
  Figures: ``python benchmarks/stages.py`` prints each stage's temporaries with and without
  ``policy: full`` (the per-stage table of docs/benchmarks.md).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.ad_checkpoint

from jzero.choices.remat import ALLOWED, NAMES, POLICIES, parse_policy_text
from jzero.choices.stages import PINNED_HOST

__all__ = [
    "LAYER_INPUT",
    "POLICIES",
    "RematPolicy",
    "parse_policy",
]

LAYER_INPUT = "jzero_layer_input"
"""The ``checkpoint_name`` jzero gives each layer's input when it is offloaded."""
ACTIVATION = "jzero_activation"
"""The ``checkpoint_name`` of every input-dependent value of a stage-3 layer under ``none``."""

_HOST = PINNED_HOST


@dataclass(frozen=True)
class RematPolicy:
    """A parsed ``activation_checkpointing`` setting.

    Attributes:
      kind: ``none``, ``full``, ``dots``, ``dots_no_batch`` or ``names``.
      names: for ``names``, the ``checkpoint_name`` tags that are saved.
      offload: keep the saved values in host memory (``cpu_checkpointing``).
      partition: shard each layer's saved input over the mesh's non-data axes
        (``partition_activations``; see :class:`jzero.rewrite.trace.Partition`).
    """

    kind: str = "full"
    names: tuple[str, ...] = ()
    offload: bool = False
    partition: bool = False

    @property
    def active(self) -> bool:
        """Whether scans are rematerialised at all (not ``none``)."""
        return self.kind != "none"

    def __str__(self) -> str:
        text = NAMES + ",".join(self.names) if self.kind == "names" else self.kind
        return text + (" (saved values in host memory)" if self.offload else "")

    def jax_policy(self) -> Callable[..., Any]:
        """The ``jax.checkpoint`` policy of a layer body. Under ``offload`` the body names its
        input :data:`LAYER_INPUT`, and that is offloaded as well."""
        if self.kind == "none":  # stage 3's meaning: keep what depends on the layer's input
            base: Callable[..., Any] = jax.checkpoint_policies.save_only_these_names(ACTIVATION)
        elif self.kind == "names":
            base = jax.checkpoint_policies.save_only_these_names(*self.names)
        else:
            base = getattr(jax.checkpoint_policies, POLICIES[self.kind])
        return _Offload(base) if self.offload else base


@dataclass(frozen=True)
class _Offload:
    """A policy that offloads to host memory whatever ``base`` saves (and the named input)."""

    base: Any

    def __call__(self, prim: Any, *args: Any, **params: Any) -> Any:
        if prim.name == "name" and params.get("name") == LAYER_INPUT:
            return jax.ad_checkpoint.Offloadable(src="device", dst=_HOST)
        saved = self.base(prim, *args, **params)
        if saved is True or saved is jax.ad_checkpoint.Saveable:
            return jax.ad_checkpoint.Offloadable(src="device", dst=_HOST)
        return jax.ad_checkpoint.Recompute


def parse_policy(
    text: str | None, *, offload: bool = False, partition: bool = False
) -> RematPolicy | None:
    """Parses an ``activation_checkpointing.policy`` value.

    Args:
      text: a policy name (see the module docstring), ``names:a,b``, or ``None`` (jzero's
        default: no checkpointing at stages 0-2, ``dots_no_batch`` for stage 3's gathered
        layers).
      offload: ``cpu_checkpointing``.

    Returns:
      The :class:`RematPolicy`; ``None`` for ``None`` without offload.

    Raises:
      ValueError: for an unknown policy (naming the allowed values), or ``offload`` without
        a policy.
    """
    if text is None:
        if offload:
            raise ValueError(
                "cpu_checkpointing keeps what a policy saves in host memory, but no policy is "
                f"set; set one of {ALLOWED} (DeepSpeed's checkpointing is full)."
            )
        return None
    kind, names = parse_policy_text(text)
    return RematPolicy(kind, names, offload, partition)
