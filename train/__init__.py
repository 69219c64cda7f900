"""train: the training framework on top of :mod:`precision`.

By feature, one package each (each ``__init__`` says what it holds and may import):

- :mod:`train.training`: training itself: any Flax model bound to a policy, the train
  state, the jitted train and eval steps, losses, checkpoints, half-precision inference;
- :mod:`train.experiment`: an experiment run from its config: the builders that turn it
  into data, task, model, optimizer and state, the loop phase by phase, its workdir,
  interrupts and what it writes;
- :mod:`train.config`: what an experiment is (YAML + ``key=value``, validated);
  :mod:`train.references`: users' code named in it (``file.py:Name``);
- :mod:`train.data`, :mod:`train.models`: offline datasets and a user's own data; plain
  Linen MLP, ResNet and GPT;
- :mod:`train.parallel`: processes, the mesh, shardings, what a step communicates;
- :mod:`train.tracking`: metrics, TensorBoard, Weights & Biases, the host's bookkeeping;
- :mod:`train.weights`: weights from another run or Hugging Face;
- :mod:`train.inspections`: an experiment looked at without training it (``--explain``,
  ``--check``, ``--diagnose``, ``--compile-for``, ``--pick-policy``);
- :mod:`train.serving`: text generation from a trained language model with a KV cache, in
  half precision and int8 (``python -m train sample``, :func:`train.generate`);
- :mod:`train.cli`: ``python -m train CONFIG key=value ...``.

The names below are the public API; modules moved from ``train.<module>`` to their
package keep their old import path for one release, with a ``DeprecationWarning``
(CHANGELOG.md).
"""

import importlib as _importlib
import importlib.abc as _importlib_abc
import importlib.util as _importlib_util
import sys as _sys
import warnings as _warnings

from train.training.binding import NNXModel, bind, cast_variables, mode_kwargs, rebind
from train.experiment.builders import build_data, build_model, build_optimizer, build_task, check_model_fits_data
from train.training.checkpoint import CheckpointError, Checkpointer
from train.config import ConfigError, ExperimentConfig, help_text, load_config
from train.data import DataError, load_dataset
from train.data.user import UserData
from train.inspections.checkup import diagnose_experiment
from train.parallel.communication import CommunicationReport, explain_communication
from train.inspections.compile_for import CompiledStep, compile_for, compile_train_step
from train.training.diagnose import diagnose_inference, diagnose_state
from train.parallel.distributed import Layout, MeshError, initialize_distributed, make_mesh
from train.training.inference import cast_for_inference, full_precision_params, inference_report
from train.experiment.loop import NonFiniteError, build_experiment, run
from train.tracking.metrics import MetricsWriter, read_metrics
from train.inspections.policy_pick import pick_policy
from train.weights.pretrained import PretrainedError, load_pretrained
from train.finetune import FineTune, FreezeError, LoRA, with_lora
from train.inspections.export import ExportError, ExportReport, export_run
from train.serving import Generation, SampleError, generate
from train.references import UserCodeError
from train.training.state import ScaledGrads, StateTooLarge, TrainState, create_train_state
from train.training.forward import blockwise_plan
from train.training.step import evaluate, make_eval_step, make_multi_step, make_train_step, summarize_eval
from train.inspections.targets import GpuTarget, TargetError, TpuTarget, get_target
from train.training.tasks import Task, cross_entropy, get_task
from train.tracking.wandb_logger import WandbLogger

__all__ = ["CheckpointError", "Checkpointer", "CommunicationReport", "CompiledStep", "ConfigError", "DataError", "ExperimentConfig", "ExportError", "ExportReport",
           "FineTune", "FreezeError", "Generation", "SampleError", "generate",
           "Layout", "LoRA", "MeshError",
           "MetricsWriter", "NNXModel", "NonFiniteError", "ScaledGrads", "StateTooLarge", "Task", "TrainState", "UserCodeError", "UserData", "WandbLogger", "bind",
           "blockwise_plan", "build_data", "build_experiment", "build_model", "build_optimizer", "build_task", "cast_for_inference",
           "cast_variables", "check_model_fits_data", "compile_for", "compile_train_step", "create_train_state", "cross_entropy", "diagnose_experiment",
           "diagnose_inference", "diagnose_state", "evaluate", "explain_communication", "export_run",
           "full_precision_params", "get_target", "get_task", "GpuTarget", "TpuTarget", "help_text", "inference_report", "initialize_distributed",
           "load_config", "load_dataset", "make_eval_step", "make_mesh", "make_multi_step", "make_train_step", "pick_policy",
           "load_pretrained", "mode_kwargs", "PretrainedError", "read_metrics", "rebind", "run", "summarize_eval", "TargetError", "with_lora"]


# ``import train.step`` (the layout before the feature packages) still works for one release: the
# module at its new path, with a DeprecationWarning. ``train.compile_for`` is the function now.
_MOVED = {"state": "training", "step": "training", "tasks": "training", "binding": "training",
          "loop": "experiment", "checkpoint": "training", "workdir": "experiment", "interrupts": "experiment",
          "outputs": "experiment", "tree_paths": "training", "inference": "training", "compile_cache": "experiment",
          "tracker": "tracking", "wandb_logger": "tracking", "metrics": "tracking", "library_log": "tracking",
          "pretrained": "weights", "huggingface": "weights", "distributed": "parallel", "communication": "parallel",
          "explain": "inspections", "checkup": "inspections", "diagnose": "training", "gpu_kernels": "inspections",
          "gpu_time": "inspections", "hlo_kernels": "inspections", "targets": "inspections",
          "policy_pick": "inspections", "policy_measure": "inspections", "builders": "experiment",
          "optimizers": "experiment"}


class _MovedModules(_importlib_abc.MetaPathFinder, _importlib_abc.Loader):
    """Finds ``train.<module>`` of the old layout: the module at its new path, with a warning."""

    def find_spec(self, fullname, path=None, target=None):
        package, _, name = fullname.rpartition(".")
        if package != __name__ or name not in _MOVED:
            return None
        return _importlib_util.spec_from_loader(fullname, self)

    def create_module(self, spec):
        name = spec.name.rpartition(".")[2]
        new = f"{__name__}.{_MOVED[name]}.{name}"
        _warnings.warn(f"{spec.name} moved to {new}; the old path goes in the next release (CHANGELOG.md)",
                       DeprecationWarning, stacklevel=2)
        return _importlib.import_module(new)

    def exec_module(self, module):
        pass


_sys.meta_path.append(_MovedModules())
