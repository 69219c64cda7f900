"""train: the training framework on top of :mod:`precision`.

A train state pytree, jitted train / eval steps (with gradient accumulation),
the training loop with metrics, checkpoints and resume, models, offline
datasets, and experiments launched from YAML configs
(``python -m train CONFIG key=value ...``).
"""

from train.checkpoint import CheckpointError, Checkpointer
from train.config import ConfigError, ExperimentConfig, help_text, load_config
from train.data import DataError, load_dataset
from train.distributed import Layout, MeshError, initialize_distributed, make_mesh
from train.inference import cast_for_inference, full_precision_params, inference_report
from train.loop import NonFiniteError, build_model, build_optimizer, run
from train.metrics import MetricsWriter, read_metrics
from train.state import TrainState, create_train_state
from train.step import cross_entropy, evaluate, make_eval_step, make_train_step, summarize_eval

__all__ = ["CheckpointError", "Checkpointer", "ConfigError", "DataError", "Layout", "MeshError",
           "initialize_distributed", "make_mesh", "ExperimentConfig", "MetricsWriter", "NonFiniteError",
           "TrainState", "build_model", "build_optimizer", "cast_for_inference", "create_train_state",
           "cross_entropy", "evaluate", "full_precision_params", "help_text", "inference_report",
           "load_config", "load_dataset", "make_eval_step", "make_train_step", "read_metrics", "run",
           "summarize_eval"]
