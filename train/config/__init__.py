"""What an experiment is: its config, from a YAML file and ``key=value`` overrides
to a validated :class:`ExperimentConfig`.

    file.yaml ─► files.load_config ─► overrides.apply_overrides ─► schema (pydantic) ─► ExperimentConfig
                                   (any error: one line naming the key, errors.ConfigError)

- :mod:`.schema`: the typed sections (``model``, ``data``, ``optimizer``,
  ``precision``, ``mesh``, ``distributed``) and the precision section's objects
  (loss scale, op lists);
- :mod:`.fields`: the types of values (numbers, counts, names of built-ins or
  references to user code, built-in models' own fields);
- :mod:`.files` and :mod:`.overrides`: reading; :mod:`.errors`: pydantic's
  errors as one line; :mod:`.help`: ``--help`` and ``docs/config.md``.
"""

from train.config.errors import ConfigError
from train.config.fields import INFERENCE_DTYPES, OPTIMIZERS, SCHEDULES, model_fields
from train.config.files import distributed_settings, from_dict, load_config, load_run_config, to_dict
from train.config.help import help_text
from train.config.overrides import apply_overrides
from train.config.schema import (SECTIONS, DataConfig, DistributedConfig, ExperimentConfig, MeshConfig, ModelConfig,
                                 OptimizerConfig, PrecisionConfig, build_loss_scale, build_op_lists)
from train.references import is_reference

__all__ = ["ConfigError", "ExperimentConfig", "ModelConfig", "DataConfig", "OptimizerConfig", "PrecisionConfig",
           "MeshConfig", "DistributedConfig", "SECTIONS", "OPTIMIZERS", "SCHEDULES", "INFERENCE_DTYPES", "load_config",
           "from_dict", "to_dict", "apply_overrides", "distributed_settings", "build_loss_scale", "build_op_lists",
           "model_fields", "is_reference", "help_text", "load_run_config"]
