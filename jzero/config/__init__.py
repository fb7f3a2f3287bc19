"""The jzero config: DeepSpeed's ``ds_config`` keys, read from YAML, JSON or a dict.

Every public name lives in one of the private modules below and is re-exported here, so
``jzero.config.X`` is the one way to reach it:

* ``_common``: ``ConfigError``, ``JzeroConfigWarning``, ``JzeroMeshWarning``, ``FrozenMap`` and
  message helpers.
* ``_sections``: DeepSpeed's nested sections (``zero_optimization``, ``bf16``, ``fp16`` ...).
* ``_schema``: the top-level ``Config`` and jzero's own sections (``mesh``, ``train`` ...).
* ``_optimizers``: optimizer and LR-schedule names, parameters and DeepSpeed's defaults.
* ``_validate``: the schema walk, "did you mean" suggestions, no-effect keys, cross-field rules
  (``_zero_checks``: those within ``zero_optimization``).
* ``_loading``: YAML/JSON reading and ``--set`` overrides (the only module importing PyYAML).
* ``_batch``: DeepSpeed's batch arithmetic.
* ``_auto``: ``"auto"`` values resolved from the code at ``jzero.initialize``.

The names a config shares with the core (the stage table, the remat policies, the pipeline
schedules) come from :mod:`jzero.choices`; the config imports nothing else of jzero's but
``jzero._util``, and :mod:`jzero.engine.settings` alone translates it into the core's options.

Decisions common to all of them: DeepSpeed's names, meanings and defaults (an existing
``ds_config.json`` loads unchanged); a ``Config`` is a frozen, hashable dataclass validated
once; every user-input error is a ``ConfigError`` whose message ends with the fix.
"""

from jzero.config._auto import LAYOUT_KEYS as LAYOUT_KEYS
from jzero.config._auto import resolve_auto as resolve_auto
from jzero.config._batch import batch_from_first_batch as batch_from_first_batch
from jzero.config._batch import resolve_batch_sizes as resolve_batch_sizes
from jzero.config._common import ConfigError as ConfigError
from jzero.config._common import FrozenMap as FrozenMap
from jzero.config._common import JzeroConfigDeprecationWarning as JzeroConfigDeprecationWarning
from jzero.config._common import JzeroConfigWarning as JzeroConfigWarning
from jzero.config._common import JzeroMeshWarning as JzeroMeshWarning
from jzero.config._loading import load_config as load_config
from jzero.config._optimizers import OPTIMIZER_PARAMS as OPTIMIZER_PARAMS
from jzero.config._optimizers import SCHEDULER_PARAMS as SCHEDULER_PARAMS
from jzero.config._optimizers import auto_keys as auto_keys
from jzero.config._optimizers import resolve_optimizer as resolve_optimizer
from jzero.config._optimizers import resolve_scheduler as resolve_scheduler
from jzero.config._schema import CheckpointConfig as CheckpointConfig
from jzero.config._schema import Config as Config
from jzero.config._schema import MeshConfig as MeshConfig
from jzero.config._schema import OptimizerConfig as OptimizerConfig
from jzero.config._schema import SchedulerConfig as SchedulerConfig
from jzero.config._schema import TrainConfig as TrainConfig
from jzero.config._sections import ActivationCheckpointingConfig as ActivationCheckpointingConfig
from jzero.config._sections import AutoLayoutConfig as AutoLayoutConfig
from jzero.config._sections import BF16Config as BF16Config
from jzero.config._sections import DataTypesConfig as DataTypesConfig
from jzero.config._sections import FP16Config as FP16Config
from jzero.config._sections import OffloadConfig as OffloadConfig
from jzero.config._sections import ZeroConfig as ZeroConfig

__all__ = [
    "OPTIMIZER_PARAMS",
    "SCHEDULER_PARAMS",
    "ActivationCheckpointingConfig",
    "AutoLayoutConfig",
    "BF16Config",
    "CheckpointConfig",
    "Config",
    "ConfigError",
    "DataTypesConfig",
    "FP16Config",
    "FrozenMap",
    "JzeroConfigDeprecationWarning",
    "JzeroConfigWarning",
    "JzeroMeshWarning",
    "MeshConfig",
    "OffloadConfig",
    "OptimizerConfig",
    "SchedulerConfig",
    "TrainConfig",
    "ZeroConfig",
    "load_config",
    "resolve_auto",
    "LAYOUT_KEYS",
    "auto_keys",
    "batch_from_first_batch",
    "resolve_batch_sizes",
    "resolve_optimizer",
    "resolve_scheduler",
]
