"""train: the training framework on top of :mod:`precision`.

A train state pytree, jitted train / eval steps (with gradient accumulation),
the training loop with metrics, checkpoints and resume, models, offline
datasets, and experiments launched from YAML configs
(``python -m train CONFIG key=value ...``) with built-in or user models
(Linen or NNX), data and losses.
"""

from train.checkpoint import CheckpointError, Checkpointer
from train.config import ConfigError, ExperimentConfig, help_text, load_config
from train.data import DataError, load_dataset
from train.distributed import Layout, MeshError, initialize_distributed, make_mesh
from train.inference import cast_for_inference, full_precision_params, inference_report
from train.builders import build_data, build_model, build_optimizer, build_task, check_model_fits_data
from train.data.user import UserData
from train.functional import NNXModel, bind, mode_kwargs
from train.loop import NonFiniteError, build_experiment, run
from train.references import UserCodeError
from train.metrics import MetricsWriter, read_metrics
from train.state import TrainState, create_train_state
from train.step import evaluate, make_eval_step, make_multi_step, make_train_step, summarize_eval
from train.tasks import Task, cross_entropy, get_task

__all__ = ["CheckpointError", "Checkpointer", "ConfigError", "DataError", "Layout", "MeshError",
           "initialize_distributed", "make_mesh", "ExperimentConfig", "MetricsWriter", "NNXModel", "NonFiniteError",
           "Task", "TrainState", "UserCodeError", "UserData", "bind", "build_data", "build_experiment",
           "build_model", "build_optimizer", "build_task", "cast_for_inference", "check_model_fits_data",
           "create_train_state", "cross_entropy", "evaluate", "full_precision_params", "get_task", "help_text",
           "inference_report", "load_config", "load_dataset", "make_eval_step", "make_multi_step", "make_train_step",
           "mode_kwargs",
           "read_metrics", "run", "summarize_eval"]
