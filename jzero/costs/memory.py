"""Bytes a device (and its host) holds: ZeRO's model states per stage and offload option, and a
transformer's activations.

Decisions:

* Model states without offload are the ZeRO paper's, mixed-precision Adam with K bytes of
  optimizer state a parameter (:meth:`~jzero.choices.stages.StageSpec.model_state_bytes`); with
  offload, DeepSpeed's estimators (``estimate_zero2_model_states_mem_needs`` where the
  parameters are whole, ``estimate_zero3_...`` where they are sharded), with their
  ``additional_buffer_factor`` and host memory per node. A stage that shards the parameters
  also holds the largest layer gathered (4 bytes a parameter: its 16-bit params and grads).
* K, the optimizer state's bytes a parameter: the fp32 master (4, none when the bf16 params are
  the masters) and Adam's two moments (4 + 4 in fp32, 2 + 2 in bf16): 12, 8 or 4.
* Activations: Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
  Models" (arXiv:2205.05198), section 4, with its tensor-parallel split; Ulysses divides every
  term by the seq axis (:func:`transformer_activations`: the paper's accounting, dropout and
  plain attention, of :func:`jzero.costs.activation_bytes`, which also counts each
  long-context technique and the logits).
"""

from __future__ import annotations

from dataclasses import dataclass

from jzero.choices.stages import StageSpec
from jzero.costs.activations import activation_bytes
from jzero.costs.shapes import ModelShape, ParallelDims

__all__ = [
    "BUFFER_FACTOR",
    "DTYPE_BYTES",
    "OPTIMIZER_DTYPES",
    "Hosts",
    "deepspeed_model_states",
    "model_states",
    "optimizer_bytes",
    "transformer_activations",
]

BUFFER_FACTOR = 1.5
"""DeepSpeed's ``additional_buffer_factor``, its estimators' slack on host memory."""
DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
"""Bytes an activation element of each dtype name."""
OPTIMIZER_DTYPES = {"fp32": "fp32", "bf16": "bf16", "bfloat16": "bf16"}
"""The optimizer state's and the master weights' dtype names, and the name each stands for."""
_OPTIMIZER_K = {"fp32": 12, "bf16": 8}
_MASTER_BYTES = {"fp32": 4, "bf16": 0}


def optimizer_bytes(optimizer: str = "fp32", master: str = "fp32") -> int:
    """K, the optimizer state's bytes a parameter, of the (canonical, :data:`OPTIMIZER_DTYPES`)
    dtype names: the fp32 master (4; 0 when ``master`` is ``"bf16"``: the bf16 params are the
    masters) and Adam's two moments (4 + 4, or 2 + 2 in ``"bf16"``).

    Example:
      >>> optimizer_bytes(), optimizer_bytes("bf16"), optimizer_bytes("bf16", "bf16")
      (12, 8, 4)
    """
    return _OPTIMIZER_K[optimizer] - 4 + _MASTER_BYTES[master]


@dataclass(frozen=True)
class Hosts:
    """Where host memory is counted: the nodes that share a group's host state, each node's
    devices, and DeepSpeed's ``additional_buffer_factor``."""

    nodes: float
    per_node: int
    buffer_factor: float = BUFFER_FACTOR


def model_states(
    spec: StageSpec,
    option: str,
    psi: float,
    n: int,
    largest_layer: float,
    hosts: Hosts,
    k: int = 12,
) -> tuple[dict[str, float], dict[str, float]]:
    """(device, host) bytes by category of ``psi`` parameters sharded over ``n`` devices at the
    stage ``spec``, with the offload ``option`` (``"none"``, ``"optimizer"`` or
    ``"optimizer+params"``): the ZeRO paper's model states without offload, DeepSpeed's
    estimators with it; sharded parameters add the largest layer gathered (4 bytes a
    parameter). ``k`` is K (:func:`optimizer_bytes`): the estimators' 16 and 18 host bytes are
    4 + K and 6 + K (fp32 gradients 4, 16-bit params 2)."""
    buf, nodes, per_node = hosts.buffer_factor, hosts.nodes, hosts.per_node
    gathered = {"gathered layer": 4 * largest_layer} if spec.shard_params else {}
    if option == "none":
        # Loading, the host holds the fp32 model (at stage 3 only the largest layer at once).
        loading = 4 * (largest_layer if spec.shard_params else psi) * per_node * buf
        return {**spec.model_state_bytes(psi, n, k), **gathered}, {"loading": loading}
    if option == "optimizer":
        params = {"params": spec.model_state_bytes(psi, n, k)["params"]}
        if spec.shard_params:
            host = (4 + k) * psi / nodes * buf
            return {**params, **gathered}, {"grads and optimizer state": host}
        return params, {"grads and optimizer state": psi * max(4 * n, 4 + k) * buf}
    return gathered, {"params, grads and optimizer state": (6 + k) * psi / nodes * buf}


def deepspeed_model_states(
    spec: StageSpec,
    option: str,
    psi: float,
    largest_layer: float,
    devices_per_node: int,
    nodes: int,
    buffer_factor: float = BUFFER_FACTOR,
) -> tuple[int, int] | None:
    """DeepSpeed's own figures, ``(device, host per node)`` bytes, as its estimators compute
    them with ``zero_init`` (parameters created in their shards); ``None`` where it has none
    (stage 0, the NVMe tier).

    Stages 1 and 2: ``estimate_zero2_model_states_mem_needs``: without offload ``2 Psi +
    int(18 Psi / N)`` on the device (16-bit params 2, and 16-bit and fp32 grads, fp32 params
    and moments 2 + 4 + 4 + 8 sharded) and ``4 Psi x devices per node x 1.5`` on the host;
    with the optimizer offloaded ``2 Psi`` and ``Psi x max(4 N, 16) x 1.5``. Stage 3:
    ``estimate_zero3_model_states_mem_needs``: ``4 LL`` on the device always (``LL`` its
    largest module's parameters), ``+ int(18 Psi / N)`` without offload (host ``4 LL x devices
    per node x 1.5``), ``+ int(2 Psi / N)`` with the optimizer offloaded (host ``16 Psi /
    nodes x 1.5``), nothing more with the parameters offloaded too (host ``18 Psi / nodes x
    1.5``). Each figure is truncated to whole bytes, as DeepSpeed's are.

    Args:
      spec: the ZeRO stage's table row: DeepSpeed's stage-3 estimator where it shards the
        parameters, its stage-1/2 one where it shards the optimizer state only.
      option: ``"none"``, ``"optimizer"`` or ``"optimizer+params"`` (``"nvme"``: None).
      psi: the parameter count.
      largest_layer: the largest module's own parameters (DeepSpeed's meaning).
      devices_per_node: devices per node.
      nodes: nodes; N = nodes x devices per node.
      buffer_factor: DeepSpeed's ``additional_buffer_factor``.

    Example:
      >>> from jzero.choices.stages import stage_spec
      >>> three = deepspeed_model_states(stage_spec(3), "none", 70e9, 1e9, 8, 1)
      >>> [round(x / 1e9, 2) for x in three]
      [161.5, 48.0]
    """
    n = nodes * devices_per_node
    if not spec.shard_opt_state or option == "nvme":  # stage 0: no estimator of DeepSpeed's
        return None
    if not spec.shard_params:
        if option == "none":
            device, host = 2 * psi + int(18 * psi / n), psi * 4 * devices_per_node * buffer_factor
        else:
            device, host = 2 * psi, psi * max(4 * n, 16) * buffer_factor
        return int(device), int(host)
    gathered = 4 * largest_layer
    if option == "none":
        device = gathered + int(18 * psi / n)
        host = largest_layer * 4 * devices_per_node * buffer_factor
    elif option == "optimizer":
        device, host = gathered + int(2 * psi / n), psi * 16 / nodes * buffer_factor
    else:
        device, host = gathered, psi * 18 / nodes * buffer_factor
    return int(device), int(host)


def transformer_activations(
    seq_len: int,
    micro_batch: int,
    hidden: int,
    layers: int,
    heads: int,
    dtype: str = "bf16",
    tensor_parallel: int = 1,
    sequence_parallel: int = 1,
) -> tuple[float, float]:
    """Activation bytes per device of a transformer's layers, without and with full recomputation,
    as the paper counts them (:data:`jzero.costs.PAPER`: plain attention with dropout, no
    logits; :func:`jzero.costs.activation_bytes` has the other techniques).

    Korthikanti et al. 2022 (arXiv:2205.05198), section 4: per layer ``s b h (34 + 5 a s / h)``
    bytes with 16-bit activations and 1-byte dropout masks. In ``fp32`` the 16-bit part doubles
    and the masks stay 1 byte: per layer ``s b h (32 k + 2) + a s^2 b (4 k + 1)``,
    k = bytes per element / 2. Full recomputation keeps each layer's input, ``2 k s b h`` per
    layer, plus one layer's activations rebuilt in the backward pass.

    Args:
      seq_len: sequence length s.
      micro_batch: micro batch per device b.
      hidden: hidden size h.
      layers: transformer layers L.
      heads: attention heads a.
      dtype: the activations' dtype, ``"bf16"``, ``"fp16"`` or ``"fp32"``.
      tensor_parallel: the model axis t: the paper's tensor-parallel split, per layer
        ``s b h (10 + 24 / t + 5 a s / (h t))`` (the norms' and residual's activations whole
        on every device of the axis, the attention's and MLP's split).
      sequence_parallel: the seq axis S (Ulysses): each device holds ``s / S`` tokens outside
        attention and ``a / S`` heads of the whole sequence inside it, so everything divides
        by S.

    Returns:
      ``(without, with_full_recomputation)`` in bytes.

    Example:
      >>> [x / 2**30 for x in transformer_activations(2048, 1, 4096, 32, 32)]  # GiB, 16-bit
      [28.5, 1.390625]
    """
    model = ModelShape(0, seq_len=seq_len, hidden=hidden, layers=layers, heads=heads)  # PAPER
    layout = ParallelDims(1, micro_batch=micro_batch, model=tensor_parallel, seq=sequence_parallel)
    without = activation_bytes(model, layout, dtype=dtype)
    full = activation_bytes(model, layout, checkpointing="full", dtype=dtype)
    return without.device, full.device
