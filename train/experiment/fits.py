"""Whether a model fits its data, its task and the machine, checked abstractly (no
compute) before anything is built for real: the model takes the data's inputs, the task
takes its outputs (one logit per class, per token for language models), it has float
params to train, few enough param arrays to compile, and a train state that fits in memory."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from train.config import ConfigError
from train.data.base import host_memory_bytes
from train.data.model_inputs import InputsError, call_with, describe_inputs
from train.references import UserCodeError, one_line
from train.training.binding import bind, inputs_as_for, mode_kwargs
from train.training.tasks import Task, builtin_task, describe_outputs

__all__ = ["LARGE_PROGRAM_ARRAYS", "MAX_PROGRAM_ARRAYS", "TRAIN_STATE_MIN_BYTES_PER_PARAM", "check_model_fits_data",
           "device_memory_bytes", "format_bytes", "with_options", "origin"]


def check_model_fits_data(model: Any, data: Any, name: str = "model", task: Task | None = None,
                          model_config: Any = None, memory: tuple[int, str] | None = None,
                          inputs_as: str = "auto") -> None:
    """Raises :class:`ConfigError` unless ``model`` takes the data's inputs and the
    task takes its outputs: one logit per class (per token for language models)
    for the built-in tasks, a scalar loss for a user's. Checked abstractly.
    ``model_config`` (its options, and where each was set) is named in the errors.
    ``memory``: (bytes, where) the train state must fit in (0: unchecked); default: this machine's.
    ``inputs_as``: how a dict of inputs is passed (``data.inputs_as``: :func:`train.training.binding.inputs_as_for`)."""
    task = task or builtin_task("auto", data.task)
    batch = data.train_batch(0, 2, 0)
    bound = bind(model, "fp32")
    sample = batch["inputs"]
    try:
        inputs_as = inputs_as_for(model, sample, inputs_as)
    except InputsError as e:
        raise ConfigError(f"model '{name}': {e}") from None
    try:
        mode = mode_kwargs(bound, False)
        variables = jax.eval_shape(
            lambda x: call_with(bound.init, x, jax.random.PRNGKey(0), inputs_as=inputs_as, **mode), sample)
        outputs = jax.eval_shape(lambda v, x: call_with(bound.apply, x, v, inputs_as=inputs_as, **mode), variables,
                                 sample)
    except Exception as e:  # noqa: BLE001 - any failure here is a model/data mismatch
        raise ConfigError(f"model '{name}' cannot take {data.name} inputs of {describe_inputs(sample)} "
                          f"({one_line(e)}){with_options(model_config)}") from None
    _check_params(variables, name, model_config, memory)
    try:
        selected = task.select(outputs)
    except UserCodeError as e:
        raise ConfigError(str(e)) from None
    if not task.builtin:
        _check_user_loss(task, outputs, batch, name)
        return
    if not data.num_classes:
        raise ConfigError(f"task: {task.name} needs the number of classes, and {data.name} gives none; return "
                          f"num_classes from your data function, or set task to your own loss")
    expected = (2,) + ((data.input_shape[0],) if task.name == "language_model" else ()) + (data.num_classes,)
    what = " per token" if task.name == "language_model" else ""
    needs = f"{data.name}, whose {task.name} needs {expected[1:]} ({data.num_classes} classes{what})"
    if not hasattr(selected, "shape"):
        raise ConfigError(f"model '{name}' outputs {describe_outputs(selected)} for {needs}: set model.output to "
                          f"the key, attribute or index holding the logits, e.g. model.output: "
                          f"{_logits_field(selected, expected)}")
    if tuple(selected.shape) != expected:
        raise ConfigError(f"model '{name}' outputs logits of shape {tuple(selected.shape)[1:]} for {needs}; set the "
                          f"model's num_classes / vocab_size / block_size to the data's or leave them unset")


#: Bytes of train state per param that any policy and optimizer need, at least: a bfloat16 param
#: (its own master) and its bfloat16 gradient. The exact figure, for the policy and optimizer, is
#: checked when the train state is built (:func:`train.experiment.builders.build_train_state`).
TRAIN_STATE_MIN_BYTES_PER_PARAM = 4


#: Param arrays from which a model's program is large enough to take minutes to trace and compile.
LARGE_PROGRAM_ARRAYS = 1000
#: Param arrays past which a model is refused before anything compiles ($MP_MAX_PARAM_ARRAYS raises it): XLA
#: compiles an unrolled program in time and memory growing faster than its size (a 2,000-layer MLP, 8,002 arrays:
#: past 6 GB after 2 minutes of compiling its init alone, until an allocation fails and the process aborts).
MAX_PROGRAM_ARRAYS = 4096


def _check_params(variables: Any, name: str, model_config: Any, memory: tuple[int, str] | None) -> None:
    """The model has float params to train, and its train state fits in ``memory`` (this machine's)."""
    params = variables.get("params") if hasattr(variables, "get") else None
    leaves = jax.tree_util.tree_leaves_with_path(params or {})
    if not leaves:
        raise ConfigError(f"model '{name}' has no parameters (no 'params' collection): there is nothing to train")
    integer = [jax.tree_util.keystr(path, simple=True, separator="/") for path, x in leaves
               if not jnp.issubdtype(x.dtype, jnp.inexact)]
    if integer:
        raise ConfigError(f"model '{name}' has params that are not floating point ({', '.join(integer[:5])}): "
                          f"gradients need floats; keep integer state in another collection "
                          f"(self.variable('constants', ...)) or an nnx.Variable that is not a Param")
    count = sum(int(np.prod(x.shape)) for _, x in leaves)
    limit = os.environ.get("MP_MAX_PARAM_ARRAYS") or str(MAX_PROGRAM_ARRAYS)
    if not limit.strip().isdigit():
        raise ConfigError(f"environment variable MP_MAX_PARAM_ARRAYS must be a number of param arrays, got {limit!r}")
    if len(leaves) > (limit := int(limit)):
        modules = len({"/".join(str(getattr(k, "key", k)) for k in path[:-1]) for path, _ in leaves})
        raise ConfigError(f"model '{name}' has {len(leaves):,} param arrays in {modules:,} modules, more than the "
                          f"{limit:,} a program is limited to: XLA's compile time and memory grow faster than an "
                          f"unrolled program (2,000 Dense layers: over 6 GB after minutes, then an abort when memory "
                          f"runs out); use fewer layers, or scan over identical ones (nn.scan, nnx.scan; gpt: "
                          f"model.scan_layers=true), or raise the limit with MP_MAX_PARAM_ARRAYS="
                          f"{len(leaves)}")
    if len(leaves) >= LARGE_PROGRAM_ARRAYS:  # tracing and compiling take a while: say so before the wait
        modules = len({"/".join(str(getattr(k, "key", k)) for k in path[:-1]) for path, _ in leaves})
        print(f"model '{name}': {len(leaves):,} param arrays in {modules:,} modules ({count:.3g} parameters); "
              f"tracing and compiling a program this large takes minutes (Ctrl-C stops it)", flush=True)
    have, where = memory or (device_memory_bytes(), "here")
    need = count * TRAIN_STATE_MIN_BYTES_PER_PARAM
    if have and need > have:
        raise ConfigError(f"model '{name}' has {count:.3g} parameters: its train state needs at least {format_bytes(need)} "
                          f"(bfloat16 params and gradients, under any policy and optimizer), more than the "
                          f"{format_bytes(have)} of memory {where}{with_options(model_config)}")


def device_memory_bytes(devices: list | None = None) -> int | None:
    """The memory a train state can use on ``devices`` (default: all local ones): the accelerators'
    as they report it, else the host's RAM."""
    devices = jax.local_devices() if devices is None else devices
    limits = [(d.memory_stats() or {}).get("bytes_limit") for d in devices if d.platform != "cpu"]
    if limits and all(limits):
        return int(sum(limits))
    return host_memory_bytes()


def format_bytes(n: float) -> str:
    """``3.3 GB``: a byte count for people."""
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n:.0f} bytes"


def with_options(model_config: Any) -> str:
    """``; its options: hidden=[256, 256] (from configs/default.yaml)``: what the model was built with."""
    if model_config is None or not model_config.options:
        return ""
    options = model_config.options.items()
    return "; its options: " + ", ".join(f"{k}={v!r}{origin(model_config, k)}" for k, v in options)


def origin(model_config: Any, key: str) -> str:
    """Where ``model.<key>`` was set, when the config was read from a file (see ``ModelConfig.origin``)."""
    origin = getattr(model_config, "origin", None)
    return origin(key) if callable(origin) else ""


def _logits_field(outputs: Any, shape: tuple) -> str:
    """The first field of ``outputs`` holding an array of ``shape`` (else ``logits``)."""
    if isinstance(outputs, dict):
        fields = list(outputs.items())
    elif isinstance(outputs, (tuple, list)):
        fields = [(str(i), x) for i, x in enumerate(outputs)]
    elif dataclasses.is_dataclass(outputs):
        fields = [(f.name, getattr(outputs, f.name)) for f in dataclasses.fields(outputs)]
    else:
        fields = []
    return next((k for k, x in fields if tuple(getattr(x, "shape", ())) == shape), "logits")


def _check_user_loss(task: Task, outputs: Any, batch: dict, name: str) -> None:
    try:
        jax.eval_shape(task.loss, outputs, batch)
        jax.eval_shape(task.eval_sums, outputs, {**batch, "mask": np.ones(2, bool)})  # per example
    except Exception as e:  # noqa: BLE001 - the user's loss does not fit the model's outputs
        raise ConfigError(f"task: {task.name} cannot take the outputs of model '{name}' ({one_line(e)})") from None
