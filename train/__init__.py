"""train: the training framework on top of :mod:`precision`.

The Python API, for your own loop:
  :mod:`train.binding` (any Flax model, Linen or NNX, under a policy as ``init`` / ``apply``),
  :mod:`train.state` (``TrainState``, ``create_train_state``), :mod:`train.step` (jitted train
  and eval steps, gradient accumulation, several steps per call), :mod:`train.tasks` (losses),
  :mod:`train.inference` (half-precision serving), :mod:`train.pretrained` (start from trained weights:
  another run's or Hugging Face Flax ones, :mod:`train.huggingface`), :mod:`train.distributed` (meshes, shardings,
  processes), :mod:`train.checkpoint`, :mod:`train.metrics`, :mod:`train.wandb_logger` (Weights & Biases); :mod:`train.compile_for` (a train
  step compiled for a GPU this machine does not have: :mod:`train.targets`, read back by
  :mod:`train.gpu_kernels`); :mod:`train.policy_pick` (``pick_policy``: the precision policy for an
  experiment, by measurement, :mod:`train.policy_measure`).

Experiments from YAML, ``python -m train CONFIG key=value ...``:
  :mod:`train.cli` → :mod:`train.config` (schema, files, overrides, errors, help) →
  :mod:`train.builders` (data, task, model, optimizer, state; user code through
  :mod:`train.references`) → :mod:`train.loop` (``run``, phase by phase; host bookkeeping in
  :mod:`train.tracker`, what a run writes in :mod:`train.outputs`, the workdir's identity in
  :mod:`train.workdir`, the libraries' noise kept in a file by :mod:`train.library_log`).

Batteries: :mod:`train.models` (plain Linen MLP, ResNet, GPT) and :mod:`train.data`
(offline datasets, your own data).
"""

from train.binding import NNXModel, bind, cast_variables, mode_kwargs, rebind
from train.builders import build_data, build_model, build_optimizer, build_task, check_model_fits_data
from train.checkpoint import CheckpointError, Checkpointer
from train.config import ConfigError, ExperimentConfig, help_text, load_config
from train.data import DataError, load_dataset
from train.data.user import UserData
from train.checkup import diagnose_experiment
from train.communication import CommunicationReport, explain_communication
from train.compile_for import CompiledStep, compile_for, compile_train_step
from train.diagnose import diagnose_state
from train.distributed import Layout, MeshError, initialize_distributed, make_mesh
from train.inference import cast_for_inference, full_precision_params, inference_report
from train.loop import NonFiniteError, build_experiment, run
from train.metrics import MetricsWriter, read_metrics
from train.policy_pick import pick_policy
from train.pretrained import PretrainedError, load_pretrained
from train.references import UserCodeError
from train.state import ScaledGrads, StateTooLarge, TrainState, create_train_state
from train.step import evaluate, make_eval_step, make_multi_step, make_train_step, summarize_eval
from train.targets import GpuTarget, TargetError, get_target
from train.tasks import Task, cross_entropy, get_task
from train.wandb_logger import WandbLogger

__all__ = ["CheckpointError", "Checkpointer", "CommunicationReport", "CompiledStep", "ConfigError", "DataError", "ExperimentConfig", "Layout", "MeshError",
           "MetricsWriter", "NNXModel", "NonFiniteError", "ScaledGrads", "StateTooLarge", "Task", "TrainState", "UserCodeError", "UserData", "WandbLogger", "bind",
           "build_data", "build_experiment", "build_model", "build_optimizer", "build_task", "cast_for_inference",
           "cast_variables", "check_model_fits_data", "compile_for", "compile_train_step", "create_train_state", "cross_entropy", "diagnose_experiment",
           "diagnose_state", "evaluate", "explain_communication",
           "full_precision_params", "get_target", "get_task", "GpuTarget", "help_text", "inference_report", "initialize_distributed",
           "load_config", "load_dataset", "make_eval_step", "make_mesh", "make_multi_step", "make_train_step", "pick_policy",
           "load_pretrained", "mode_kwargs", "PretrainedError", "read_metrics", "rebind", "run", "summarize_eval", "TargetError"]
