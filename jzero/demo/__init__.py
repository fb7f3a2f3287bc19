"""The built-in model: the demo GPT, its byte-level data, and ``jzero plan``'s measurement.

Everything that knows the built-in model lives here, so the library below it (the engine, the
plan, the step, the memory estimator) knows no model of its own:

* :mod:`~jzero.demo.gpt`: the built-in byte-level GPT, as a plain pytree and as a Flax NNX
  module (``GPT``, ``GPTConfig``, ``config_for``).
* :mod:`~jzero.demo.data`: byte-level text that ships with every Python, and the resumable
  :class:`~jzero.demo.data.BatchIterator`.
* :mod:`~jzero.demo.plan`: ``jzero plan``'s measurement, :func:`plan_report`: the built-in GPT
  of a config at every stage (:func:`jzero.memory.measure_stages` with this model).

Import direction: imports the engine, :mod:`jzero.memory`, :mod:`jzero.monitor` and the rest
of the library; only :mod:`jzero.cli` and :mod:`jzero.train` (for a config that trains the
built-in GPT) import it.
"""

from jzero.demo import data as data
from jzero.demo import gpt as gpt
from jzero.demo import plan as plan
from jzero.demo.data import BatchIterator as BatchIterator
from jzero.demo.gpt import GPT as GPT
from jzero.demo.gpt import GPTConfig as GPTConfig
from jzero.demo.plan import plan_report as plan_report

__all__ = [
    "BatchIterator",
    "data",
    "GPT",
    "GPTConfig",
    "gpt",
    "plan",
    "plan_report",
]
