"""``jzero.hlo.program_text`` reads the program as jzero emits it (16-bit collectives before the
CPU compiler widens them), also when JAX's persistent compilation cache already holds the
program: the cache's key leaves out the dump options, so a cached program would dump nothing."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jzero.distributed import enable_compile_cache
from jzero.hlo import collectives, program_text


def _bf16_sum():
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))

    def body(x):
        return jax.lax.psum(x, "data")

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=P()))
    return f.lower(jnp.ones((8, 4), jnp.bfloat16))


def test_program_text_keeps_16_bit_collectives_with_the_program_in_the_cache(tmp_path):
    restore = enable_compile_cache(tmp_path / "cache")
    try:
        lowered = _bf16_sum()
        final = lowered.compile().as_text()  # now in the cache, its all-reduce widened to f32
        assert "f32" in next(line for line in final.splitlines() if "all-reduce(" in line)
        text = program_text(lowered)
    finally:
        restore()
    (line,) = [line for line in text.splitlines() if " all-reduce(" in line]
    assert "bf16" in line, line
    assert collectives(text)["all-reduce"].bytes == np.prod((1, 4)) * 2  # one device's bf16 row
