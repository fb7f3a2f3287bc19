"""Storage that fails under `jzero train`: a compile cache that can't be written is one warning,
never an error."""

import logging

import jax
import jax.numpy as jnp

from jzero.distributed import enable_compile_cache


def test_a_compile_cache_that_cannot_be_written_is_one_warning(tmp_path, caplog):
    """pytest turns warnings into errors here (pyproject), as `-W error` does: JAX's warning for
    each entry it can't write or read would be an exception inside the compilation."""
    cache = tmp_path / "cache"
    restore = enable_compile_cache(cache)
    try:
        jax.jit(lambda x: x - 1)(jnp.ones(2)).block_until_ready()  # the cache is in use
        for entry in cache.iterdir():
            entry.unlink()
        cache.rmdir()
        cache.write_text("")  # a file where the folder was: every entry fails
        with caplog.at_level(logging.DEBUG, logger="jzero"):
            for n in (3, 5):  # two programs: each fails to be read, then to be written
                jax.jit(lambda x: x * 2 + 1)(jnp.ones(n)).block_until_ready()
    finally:
        restore()
    warned = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warned) == 1, [r.getMessage() for r in warned]
    assert f"the compile cache in {cache} can't be used (" in warned[0].getMessage()
    assert any("compile cache: Error" in r.getMessage() for r in caplog.records)  # the others
    # A cache folder that can't be made leaves the cache off for the run, with one warning.
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="jzero"):
        enable_compile_cache(cache / "inside-a-file")()
    assert [r.getMessage()[:40] for r in caplog.records] == [
        f"jzero: the compile cache folder {cache}"[:40]
    ]
