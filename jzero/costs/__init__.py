"""The one cost model: the bytes, traffic and step time of a model shape on a parallel layout.

Pure formulas over (model shape, layout, rates).

Import direction: imports only the stage table and the pipeline's schedule tables
(:mod:`jzero.choices`, so the formulas load without JAX), never the plan, the parallelisms, the
engine, the demo, the memory planner, the config or the CLI (``tests/project/test_house.py``
checks it); read by :func:`jzero.memory.estimate` (``jzero estimate``) and by the auto layout's
ranking (:mod:`jzero.engine.auto_layout`, ``jzero plan --auto``), so the two never count a byte
apart.

* :mod:`~jzero.costs.shapes`: the values: :class:`ModelShape` (with its
  :class:`Techniques`, how its layers keep activations), :class:`ParallelDims` (the mesh's
  axes and sizes, with the degrees derived from them) and :class:`Dtypes`.
* :mod:`~jzero.costs.architectures`: today's transformer shapes (:class:`Architecture`:
  SwiGLU or GELU, RMSNorm or LayerNorm, rotary or learned positions, grouped-query attention,
  tied or untied embeddings, experts), their parameter counts and largest layers, and
  :data:`PRESETS` of published ones.
* :mod:`~jzero.costs.activations`: a transformer's activations per device with each
  long-context technique (blockwise attention, tiled loss and MLP, activation offload, the
  ``seq`` and ``context`` splits; :func:`activation_bytes`) and the longest sequence that fits
  (:func:`longest_sequence`).
* :mod:`~jzero.costs.memory`: bytes held: ZeRO's model states per stage and offload
  (:func:`model_states`), DeepSpeed's own estimators' figures beside them
  (:func:`deepspeed_model_states`), a transformer's activations
  (:func:`transformer_activations`).
* :mod:`~jzero.costs.traffic`: bytes a step on each axis (ZeRO's group, ``model``, ``seq``,
  ``context``, ``expert``, ``pipe``, the host) and which cross hosts.
* :mod:`~jzero.costs.step_time`: the step's predicted time at :class:`Rates`
  (:func:`predict`).
"""

from jzero.costs.activations import ATTENTIONS as ATTENTIONS
from jzero.costs.activations import CHECKPOINTING as CHECKPOINTING
from jzero.costs.activations import ActivationBytes as ActivationBytes
from jzero.costs.activations import activation_bytes as activation_bytes
from jzero.costs.activations import longest_sequence as longest_sequence
from jzero.costs.activations import sequence_step as sequence_step
from jzero.costs.architectures import PRESETS as PRESETS
from jzero.costs.architectures import Architecture as Architecture
from jzero.costs.memory import BUFFER_FACTOR as BUFFER_FACTOR
from jzero.costs.memory import DTYPE_BYTES as DTYPE_BYTES
from jzero.costs.memory import OPTIMIZER_DTYPES as OPTIMIZER_DTYPES
from jzero.costs.memory import Hosts as Hosts
from jzero.costs.memory import deepspeed_model_states as deepspeed_model_states
from jzero.costs.memory import model_states as model_states
from jzero.costs.memory import optimizer_bytes as optimizer_bytes
from jzero.costs.memory import transformer_activations as transformer_activations
from jzero.costs.shapes import AXES as AXES
from jzero.costs.shapes import PAPER as PAPER
from jzero.costs.shapes import Dtypes as Dtypes
from jzero.costs.shapes import ModelShape as ModelShape
from jzero.costs.shapes import ParallelDims as ParallelDims
from jzero.costs.shapes import Techniques as Techniques
from jzero.costs.step_time import PLATFORM_RATES as PLATFORM_RATES
from jzero.costs.step_time import Prediction as Prediction
from jzero.costs.step_time import Rates as Rates
from jzero.costs.step_time import Work as Work
from jzero.costs.step_time import bubble as bubble
from jzero.costs.step_time import predict as predict
from jzero.costs.traffic import LayerFlow as LayerFlow
from jzero.costs.traffic import context_axis_bytes as context_axis_bytes
from jzero.costs.traffic import cross_host_elements as cross_host_elements
from jzero.costs.traffic import crosses_hosts as crosses_hosts
from jzero.costs.traffic import expert_axis_bytes as expert_axis_bytes
from jzero.costs.traffic import model_axis_bytes as model_axis_bytes
from jzero.costs.traffic import offload_bytes as offload_bytes
from jzero.costs.traffic import pipe_axis_bytes as pipe_axis_bytes
from jzero.costs.traffic import ring as ring
from jzero.costs.traffic import seq_axis_bytes as seq_axis_bytes
from jzero.costs.traffic import zero_bytes as zero_bytes

__all__ = [
    "ATTENTIONS",
    "AXES",
    "BUFFER_FACTOR",
    "CHECKPOINTING",
    "DTYPE_BYTES",
    "OPTIMIZER_DTYPES",
    "PAPER",
    "PLATFORM_RATES",
    "PRESETS",
    "ActivationBytes",
    "Architecture",
    "Dtypes",
    "Hosts",
    "LayerFlow",
    "ModelShape",
    "ParallelDims",
    "Prediction",
    "Rates",
    "Techniques",
    "Work",
    "activation_bytes",
    "bubble",
    "context_axis_bytes",
    "cross_host_elements",
    "deepspeed_model_states",
    "crosses_hosts",
    "expert_axis_bytes",
    "longest_sequence",
    "model_axis_bytes",
    "model_states",
    "offload_bytes",
    "optimizer_bytes",
    "pipe_axis_bytes",
    "predict",
    "ring",
    "seq_axis_bytes",
    "sequence_step",
    "transformer_activations",
    "zero_bytes",
]
