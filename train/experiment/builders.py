"""From config sections to objects: the data, the model, the task and the
optimizer an experiment names, built-in or the user's own, each checked
against the others abstractly (no compute) so a bad reference fails in one
line before anything compiles."""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import os
import typing
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import flax.linen as nn
from flax import nnx

import precision

from train import config as config_lib
from train.config import ConfigError
from train.data import DATASETS, DataError, load_dataset
from train.data.base import host_memory_bytes
from train.data.checks import check_data
from train.data.user import from_user_function
from train.training.binding import bind, mode_kwargs
from train.data.model_inputs import call_with, describe_inputs
from train.models import MODELS
from train.experiment.optimizers import build_optimizer
from train.references import UserCodeError, one_line, resolve
from train.weights.pretrained import PretrainedError, checkpoint_steps
from train.training.state import StateTooLarge, create_train_state
from train.training.tasks import Task, describe_outputs, get_task

__all__ = ["build_data", "build_model", "build_optimizer", "build_task", "build_train_state",
           "check_model_fits_data", "model_options"]


def build_data(data_config: Any, seed: int) -> Any:
    """The dataset ``data.name`` names: a shipped one, or a user's function
    (``module:function``) called with ``data.options``; checked for data no model
    can learn from (:func:`train.data.checks.check_data`)."""
    if data_config.name in DATASETS:
        options = data_config.model_dump(exclude={"name", "options"})
        data = load_dataset(data_config.name, **options, seed=seed)
    else:
        try:
            fn = resolve(data_config.name, "data.name")
        except UserCodeError as e:
            raise DataError(str(e)) from None
        if not callable(fn):
            raise DataError(f"data.name: {data_config.name} is a {type(fn).__name__}, not a function returning data")
        data = from_user_function(fn, dict(getattr(data_config, "options", {}) or {}))
    check_data(data, data_config)  # data no model learns from, or a data.* key it would ignore: before compute
    return data


def build_task(spec: str, data: Any, output: str | int | None = None) -> Task:
    """The task ``spec`` (``auto``: the data's) as a :class:`train.training.tasks.Task`, reading
    the ``output`` field of the model's output (``model.output``)."""
    try:
        return get_task(spec, getattr(data, "task", None), output=output)
    except UserCodeError as e:
        raise ConfigError(str(e)) from None


def _data_defaults(data: Any) -> dict[str, Any]:
    """Constructor arguments a model may take that default to the data's."""
    length = data.input_shape[0] if data.input_shape else None
    values = {"num_classes": data.num_classes, "vocab_size": data.num_classes, "block_size": length,
              "max_len": length, "seq_len": length}
    return {k: v for k, v in values.items() if v is not None}


def model_options(model_config: Any, data: Any) -> dict[str, Any]:
    """The model's constructor arguments: the config's, plus those that default
    to the data's (class counts, vocabulary, context length) when it takes them."""
    options = dict(model_config.options)
    if model_config.name in MODELS:
        names = set(config_lib.model_fields(model_config.name))
    else:
        names = set(_parameters(_resolve_model(model_config.name)))
    for name, value in _data_defaults(data).items():
        if name in names:
            options.setdefault(name, value)
    return options


def build_model(model_config: Any, data: Any, seed: int = 0) -> Any:
    """The model a config names: a built-in Linen model, or a user's Linen / NNX
    class or factory (``module:Name``) built with the other ``model.*`` keys as
    keyword arguments (a mapping given for an argument annotated with a
    dataclass, such as a Flax model config, builds that dataclass; an NNX
    model's ``rngs`` comes from ``seed``)."""
    options = model_options(model_config, data)
    if model_config.name in MODELS:
        options = {k: tuple(v) if isinstance(v, list) else v for k, v in options.items()}
        return MODELS[model_config.name](**options)
    target = _resolve_model(model_config.name)
    kwargs = _constructor_kwargs(target, options, seed, model_config)
    try:
        model = target(**kwargs)
    except ConfigError:  # a factory that names the key itself (train.weights.huggingface:model)
        raise
    except Exception as e:  # noqa: BLE001 - the user's constructor raised
        raise ConfigError(f"model.name: {model_config.name}(**model) raised {one_line(e)}"
                          f"{_with_options(model_config)}") from None
    if not isinstance(model, (nn.Module, nnx.Module)):
        raise ConfigError(f"model.name: {model_config.name} gave a {type(model).__name__}, not a flax.linen.Module "
                          f"or flax.nnx.Module")
    return model


def _resolve_model(reference: str) -> Any:
    try:
        target = resolve(reference, "model.name")
    except UserCodeError as e:
        raise ConfigError(str(e)) from None
    if not callable(target):
        raise ConfigError(f"model.name: {reference} is a {type(target).__name__}, not a model class or factory")
    return target


def _parameters(target: Any) -> dict[str, inspect.Parameter]:
    linen = isinstance(target, type) and issubclass(target, nn.Module)
    # NNX (and other metaclass-made) classes hide their __init__ signature behind the metaclass.
    fn = target.__init__ if isinstance(target, type) and not linen else target
    try:
        params = dict(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return {}
    if fn is not target:
        params.pop(next(iter(params), None), None)  # self
    return {k: p for k, p in params.items() if not (linen and k in ("parent", "name"))}


def _constructor_kwargs(target: Any, options: dict[str, Any], seed: int, model_config: Any) -> dict[str, Any]:
    """``options`` checked against ``target``'s signature; dataclass arguments built."""
    params = _parameters(target)
    name = getattr(target, "__name__", str(target))
    takes_any = any(p.kind == p.VAR_KEYWORD for p in params.values())
    for key, value in options.items():
        if key not in params and not takes_any:
            close = difflib.get_close_matches(key, list(params), n=1)
            hint = f" Did you mean 'model.{close[0]}'?" if close else ""
            raise ConfigError(f"model.{key}: {name} takes no argument '{key}'.{hint} Its arguments: "
                              f"{', '.join(params) or 'none'} (model.{key}={value!r}{_origin(model_config, key)})")
    kwargs = dict(options)
    if "rngs" in params and "rngs" not in kwargs:
        kwargs["rngs"] = nnx.Rngs(seed)
    try:
        hints = typing.get_type_hints(target if isinstance(target, type) and issubclass(target, nn.Module)
                                      else getattr(target, "__init__", target) if isinstance(target, type)
                                      else target)
    except Exception:  # noqa: BLE001 - unresolvable annotations: use the values as given
        hints = {}
    for key, value in list(kwargs.items()):
        cls = hints.get(key)
        if isinstance(value, dict) and isinstance(cls, type) and dataclasses.is_dataclass(cls):
            kwargs[key] = _build_dataclass(cls, value, f"model.{key}")
        elif isinstance(value, list) and typing.get_origin(cls) is tuple:
            kwargs[key] = tuple(value)
    missing = [k for k, p in params.items() if p.default is p.empty and k not in kwargs
               and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    if missing:
        raise ConfigError(f"model.{missing[0]}: {name} needs argument '{missing[0]}'; set "
                          f"{', '.join('model.' + m for m in missing)} in the config")
    return kwargs


def _build_dataclass(cls: type, values: dict, key: str) -> Any:
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    for name in values:
        if name not in fields:
            close = difflib.get_close_matches(name, list(fields), n=1)
            hint = f" Did you mean '{key}.{close[0]}'?" if close else ""
            raise ConfigError(f"{key}.{name}: {cls.__name__} has no field '{name}'.{hint} Its fields: "
                              f"{', '.join(fields)}")
    try:
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in values.items()})
    except Exception as e:  # noqa: BLE001 - the dataclass rejected the values
        raise ConfigError(f"{key}: {cls.__name__}(...) raised {one_line(e)}") from None


def check_model_fits_data(model: Any, data: Any, name: str = "model", task: Task | None = None,
                          model_config: Any = None, memory: tuple[int, str] | None = None) -> None:
    """Raises :class:`ConfigError` unless ``model`` takes the data's inputs and the
    task takes its outputs: one logit per class (per token for language models)
    for the built-in tasks, a scalar loss for a user's. Checked abstractly.
    ``model_config`` (its options, and where each was set) is named in the errors.
    ``memory``: (bytes, where) the train state must fit in (0: unchecked); default: this machine's."""
    task = task or get_task("auto", data.task)
    batch = data.train_batch(0, 2, 0)
    bound = bind(model, "fp32")
    sample = batch["inputs"]
    try:
        mode = mode_kwargs(bound, False)
        variables = jax.eval_shape(lambda x: call_with(bound.init, x, jax.random.PRNGKey(0), **mode), sample)
        outputs = jax.eval_shape(lambda v, x: call_with(bound.apply, x, v, **mode), variables, sample)
    except Exception as e:  # noqa: BLE001 - any failure here is a model/data mismatch
        raise ConfigError(f"model '{name}' cannot take {data.name} inputs of {describe_inputs(sample)} "
                          f"({one_line(e)}){_with_options(model_config)}") from None
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
#: checked when the train state is built (:func:`build_train_state`).
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
        raise ConfigError(f"model '{name}' has {count:.3g} parameters: its train state needs at least {_bytes(need)} "
                          f"(bfloat16 params and gradients, under any policy and optimizer), more than the "
                          f"{_bytes(have)} of memory {where}{_with_options(model_config)}")


def device_memory_bytes(devices: list | None = None) -> int | None:
    """The memory a train state can use on ``devices`` (default: all local ones): the accelerators'
    as they report it, else the host's RAM."""
    devices = jax.local_devices() if devices is None else devices
    limits = [(d.memory_stats() or {}).get("bytes_limit") for d in devices if d.platform != "cpu"]
    if limits and all(limits):
        return int(sum(limits))
    return host_memory_bytes()


def _bytes(n: float) -> str:
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n:.0f} bytes"


def _with_options(model_config: Any) -> str:
    """``; its options: hidden=[256, 256] (from configs/default.yaml)``: what the model was built with."""
    if model_config is None or not model_config.options:
        return ""
    options = model_config.options.items()
    return "; its options: " + ", ".join(f"{k}={v!r}{_origin(model_config, k)}" for k, v in options)


def _origin(model_config: Any, key: str) -> str:
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


def build_train_state(config: Any, model: Any, data: Any, layout: Any = None,
                      memory: tuple[int, str] | None = None) -> tuple[Any, optax.Schedule]:
    """The train state ``config`` starts from (policy, rules, op lists, loss scale,
    optimizer, clipping, layout) and its learning-rate schedule. ``memory``: (bytes,
    where) the state must fit in (0: unchecked); default: this machine's.

    Raises:
      ConfigError: the model cannot be built from the data's inputs, or
        ``precision.strict`` and the policy leaves its matmuls in float32.
    """
    tx, schedule = build_optimizer(config.optimizer, config.steps)
    have, where = memory or (device_memory_bytes(), "here")
    try:
        state = create_train_state(
            model, config.precision.policy, tx, jax.random.PRNGKey(config.seed), data.sample_input(1),
            rules=config.precision.rules, loss_scale=config_lib.build_loss_scale(config.precision),
            max_grad_norm=config.optimizer.max_grad_norm, skip_with=config.precision.skip_with, layout=layout,
            ops=config_lib.build_op_lists(config.precision), autocast=config.precision.autocast,
            strict=config.precision.strict, fp8=config.precision.fp8.options(),
            reduce_dtype=config.precision.reduce_dtype, init_from=_init_from(config), memory=have)
    except StateTooLarge as e:
        raise ConfigError(f"model '{config.model.name}': its train state under {config.precision.policy} with "
                          f"{config.optimizer.name} needs {_bytes(e.need)} ({e.parts()}), more than the "
                          f"{_bytes(have)} of memory {where}{_with_options(config.model)}") from None
    except PretrainedError as e:
        raise ConfigError(f"model.{e}") from None
    except precision.CoverageError as e:
        raise ConfigError(f"precision.strict: {e}") from None
    except precision.PolicyError as e:  # the schema parsed the policy and rules: only reduce_dtype is left
        raise ConfigError(f"precision.{str(e).removeprefix('create_train_state: ')}") from None
    except (ValueError, TypeError) as e:
        raise ConfigError(f"model '{config.model.name}' with {config.model.options or 'its defaults'} "
                          f"cannot be built: {str(e).removeprefix('create_train_state: ')}") from None
    return state, schedule


def _init_from(config: Any) -> str | None:
    """``model.init_from``, unless the run's workdir has checkpoints: it resumes from them instead."""
    resuming = checkpoint_steps(os.path.join(os.path.abspath(config.workdir), "checkpoints"))
    return None if resuming else config.model.init_from
