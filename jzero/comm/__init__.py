"""The collectives jzero emits: ZeRO++'s quantized collectives, gradient buckets, XLA options.

Import direction: imports nothing else of jzero's; imported by :mod:`jzero.rewrite` and
:mod:`jzero.step`.

* :mod:`~jzero.comm.quantization`: block-quantized all-gather (qwZ) and reduce-scatter (qgZ).
* :mod:`~jzero.comm.overlap`: ``overlap_comm``'s buckets and the compiler options.
* :mod:`~jzero.comm.manual`: ZeRO's collectives on arrays split over other axes (tensor
  parallelism), run with those axes manual too.

``jzero.comm.quantize`` is the function; its module is ``quantization``.
"""

from jzero.comm.manual import over_axes as over_axes
from jzero.comm.manual import spec_axes as spec_axes
from jzero.comm.manual import trailing_spec as trailing_spec
from jzero.comm.overlap import CPU_PARTLY_MANUAL_BF16_OPTIONS as CPU_PARTLY_MANUAL_BF16_OPTIONS
from jzero.comm.overlap import GPU_ASYNC_OPTIONS as GPU_ASYNC_OPTIONS
from jzero.comm.overlap import bucket_groups as bucket_groups
from jzero.comm.overlap import compiler_options as compiler_options
from jzero.comm.overlap import from_rows as from_rows
from jzero.comm.overlap import gather_buckets as gather_buckets
from jzero.comm.overlap import reduce_buckets as reduce_buckets
from jzero.comm.overlap import to_rows as to_rows
from jzero.comm.quantization import dequantize as dequantize
from jzero.comm.quantization import quantize as quantize
from jzero.comm.quantization import quantized_all_gather as quantized_all_gather
from jzero.comm.quantization import quantized_psum as quantized_psum
from jzero.comm.quantization import quantized_psum_scatter as quantized_psum_scatter

__all__ = [
    "bucket_groups",
    "compiler_options",
    "dequantize",
    "from_rows",
    "gather_buckets",
    "CPU_PARTLY_MANUAL_BF16_OPTIONS",
    "GPU_ASYNC_OPTIONS",
    "over_axes",
    "quantize",
    "quantized_all_gather",
    "quantized_psum",
    "quantized_psum_scatter",
    "reduce_buckets",
    "spec_axes",
    "to_rows",
    "trailing_spec",
]
