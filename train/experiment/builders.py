"""From config sections to objects: the data, the model, the task, the optimizer
and the train state an experiment names, built-in or the user's own, built from the
names resolved once (:mod:`train.experiment.names`; the ``*_from`` functions) and
checked against each other abstractly (:mod:`train.experiment.fits`) so a bad
config fails in one line before anything compiles. ``build_*`` resolve and build
in one call, for a loop of your own."""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import os
import typing
from typing import Any

import jax
import optax
import flax.linen as nn
from flax import nnx

import precision

from train import config as config_lib
from train.config import ConfigError
from train.data import load_dataset
from train.data.checks import check_data
from train.data.user import from_user_function
from train.experiment.fits import (LARGE_PROGRAM_ARRAYS, MAX_PROGRAM_ARRAYS, TRAIN_STATE_MIN_BYTES_PER_PARAM,  # noqa: F401
                                  check_model_fits_data, device_memory_bytes, format_bytes, origin, with_options)
from train.experiment.optimizers import build_optimizer, optimizer_from
from train.experiment.names import Names, Resolved, resolve_data, resolve_model, resolve_names, resolve_task
from train.references import UserCodeError, one_line
from train.weights.pretrained import PretrainedError, checkpoint_steps
from train.finetune import FineTune, FreezeError, LoRA
from train.parallel.tensor.planning import TensorLayoutError
from train.training.state import StateTooLarge, create_train_state
from train.training.tasks import Task, builtin_task, user_task

__all__ = ["build_data", "build_experiment", "build_model", "build_optimizer", "build_task", "build_train_state",
           "data_from", "experiment_from", "model_from", "options_from", "task_from", "train_state_from",
           "check_model_fits_data", "model_options"]


def build_experiment(config: Any, memory: tuple[int, str] | None = None) -> tuple[Any, Task, Any]:
    """The data, task and (unwrapped) model ``config`` names, checked to fit
    each other before any compute (:class:`ConfigError` / ``DataError`` if not).
    ``memory``: (bytes, where) its train state must fit in (0: unchecked); default: this machine's."""
    return experiment_from(resolve_names(config), config, memory)


def experiment_from(names: Names, config: Any, memory: tuple[int, str] | None = None) -> tuple[Any, Task, Any]:
    """:func:`build_experiment` from the config's names resolved (:func:`train.experiment.names.resolve_names`)."""
    data = data_from(names.data, config.data, config.seed)
    task = task_from(names.task, data, config.model.output)
    model = model_from(names.model, config.model, data, config.seed)
    check_model_fits_data(model, data, config.model.name, task, config.model, memory, config.data.inputs_as)
    return data, task, model


def build_data(data_config: Any, seed: int) -> Any:
    """The dataset ``data.name`` names: a shipped one, or a user's function
    (``module:function``) called with ``data.options``; checked for data no model
    can learn from (:func:`train.data.checks.check_data`)."""
    return data_from(resolve_data(data_config.name), data_config, seed)


def build_task(spec: Any, data: Any, output: str | int | None = None) -> Task:
    """The task ``spec`` (``auto``: the data's) as a :class:`train.training.tasks.Task`, reading
    the ``output`` field of the model's output (``model.output``)."""
    if isinstance(spec, Task):
        return spec if output is None else spec._replace(output=output)
    return task_from(resolve_task(spec), data, output)


def build_model(model_config: Any, data: Any, seed: int = 0) -> Any:
    """The model a config names: a built-in Linen model, or a user's Linen / NNX
    class or factory (``module:Name``) built with the other ``model.*`` keys as
    keyword arguments (a mapping given for an argument annotated with a
    dataclass, such as a Flax model config, builds that dataclass; an NNX
    model's ``rngs`` comes from ``seed``)."""
    return model_from(resolve_model(model_config.name), model_config, data, seed)


def model_options(model_config: Any, data: Any) -> dict[str, Any]:
    """The model's constructor arguments: the config's, plus those that default
    to the data's (class counts, vocabulary, context length) when it takes them."""
    return options_from(resolve_model(model_config.name), model_config, data)


def data_from(source: Resolved, data_config: Any, seed: int) -> Any:
    """:func:`build_data` from ``data.name`` resolved (:func:`train.experiment.names.resolve_data`)."""
    if source.target is None:
        options = data_config.model_dump(exclude={"name", "options"})
        data = load_dataset(source.name, **options, seed=seed)
    else:
        data = from_user_function(source.target, dict(getattr(data_config, "options", {}) or {}))
    check_data(data, data_config)  # data no model learns from, or a data.* key it would ignore: before compute
    return data


def task_from(resolved: Resolved, data: Any, output: str | int | None = None) -> Task:
    """:func:`build_task` from ``task`` resolved (:func:`train.experiment.names.resolve_task`)."""
    if resolved.target is not None:
        return user_task(resolved.target, resolved.name, output=output)
    try:
        return builtin_task(resolved.name, getattr(data, "task", None), output=output)
    except UserCodeError as e:
        raise ConfigError(str(e)) from None


def options_from(resolved: Resolved, model_config: Any, data: Any) -> dict[str, Any]:
    """:func:`model_options` from ``model.name`` resolved (:func:`train.experiment.names.resolve_model`)."""
    options = dict(model_config.options)
    if resolved.builtin:
        names = set(config_lib.model_fields(resolved.name))
    else:
        names = set(_parameters(resolved.target))
    for name, value in _data_defaults(data).items():
        if name in names:
            options.setdefault(name, value)
    return options


def model_from(resolved: Resolved, model_config: Any, data: Any, seed: int = 0) -> Any:
    """:func:`build_model` from ``model.name`` resolved (:func:`train.experiment.names.resolve_model`)."""
    options = options_from(resolved, model_config, data)
    if resolved.builtin:
        options = {k: tuple(v) if isinstance(v, list) else v for k, v in options.items()}
        return resolved.target(**options)
    kwargs = _constructor_kwargs(resolved.target, options, seed, model_config)
    try:
        model = resolved.target(**kwargs)
    except ConfigError:  # a factory that names the key itself (train.weights.huggingface:model)
        raise
    except Exception as e:  # noqa: BLE001 - the user's constructor raised
        raise ConfigError(f"model.name: {model_config.name}(**model) raised {one_line(e)}"
                          f"{with_options(model_config)}") from None
    if not isinstance(model, (nn.Module, nnx.Module)):
        raise ConfigError(f"model.name: {model_config.name} gave a {type(model).__name__}, not a flax.linen.Module "
                          f"or flax.nnx.Module")
    return model


def _parameters(target: Any) -> dict[str, inspect.Parameter]:
    """The constructor arguments of a model class or factory, by name (a Linen module's
    ``parent`` and ``name`` left out; empty when it has no signature to read)."""
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


def _data_defaults(data: Any) -> dict[str, Any]:
    """Constructor arguments a model may take that default to the data's."""
    length = data.input_shape[0] if data.input_shape else None
    values = {"num_classes": data.num_classes, "vocab_size": data.num_classes, "block_size": length,
              "max_len": length, "seq_len": length}
    return {k: v for k, v in values.items() if v is not None}


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
                              f"{', '.join(params) or 'none'} (model.{key}={value!r}{origin(model_config, key)})")
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
        elif isinstance(value, list) and typing.getorigin(cls) is tuple:
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


def build_train_state(config: Any, model: Any, data: Any, layout: Any = None,
                      memory: tuple[int, str] | None = None) -> tuple[Any, optax.Schedule]:
    """The train state ``config`` starts from (policy, rules, op lists, loss scale,
    optimizer, clipping, layout) and its learning-rate schedule. ``memory``: (bytes,
    where) the state must fit in (0: unchecked); default: this machine's.

    Raises:
      ConfigError: the model cannot be built from the data's inputs, or
        ``precision.strict`` and the policy leaves its matmuls in float32.
    """
    return train_state_from(resolve_names(config), config, model, data, layout, memory)


def train_state_from(names: Names, config: Any, model: Any, data: Any, layout: Any = None,
                     memory: tuple[int, str] | None = None) -> tuple[Any, optax.Schedule]:
    """:func:`build_train_state` from the config's names resolved (:func:`train.experiment.names.resolve_names`)."""
    tx, schedule = optimizer_from(config.optimizer, config.steps, names.optimizer, names.schedule)
    have, where = memory or (device_memory_bytes(), "here")
    try:
        state = create_train_state(
            model, config.precision.policy, tx, jax.random.PRNGKey(config.seed), data.sample_input(1),
            rules=config.precision.rules, loss_scale=config_lib.build_loss_scale(config.precision),
            max_grad_norm=config.optimizer.max_grad_norm, skip_with=config.precision.skip_with, layout=layout,
            ops=config_lib.build_op_lists(config.precision), autocast=config.precision.autocast,
            strict=config.precision.strict, fp8=config.precision.fp8.options(), int8=config.precision.int8.options(),
            reduce_dtype=config.precision.reduce_dtype, init_from=_init_from(config), memory=have,
            finetune=finetune_from(config.finetune), inputs_as=config.data.inputs_as)
    except FreezeError as e:  # its message names the key
        raise ConfigError(str(e)) from None
    except StateTooLarge as e:
        raise ConfigError(f"model '{config.model.name}': its train state under {config.precision.policy} with "
                          f"{config.optimizer.name} needs {format_bytes(e.need)} ({e.parts()}), more than the "
                          f"{format_bytes(have)} of memory {where}{with_options(config.model)}") from None
    except PretrainedError as e:
        raise ConfigError(f"model.{e}") from None
    except precision.CoverageError as e:
        raise ConfigError(f"precision.strict: {e}") from None
    except TensorLayoutError as e:  # its message names the key (mesh.tensor, sharding.rules)
        raise ConfigError(str(e)) from None
    except precision.PolicyError as e:  # the schema parsed the policy and rules: only reduce_dtype is left
        raise ConfigError(f"precision.{str(e).removeprefix('create_train_state: ')}") from None
    except (ValueError, TypeError) as e:
        raise ConfigError(f"model '{config.model.name}' with {config.model.options or 'its defaults'} "
                          f"cannot be built: {str(e).removeprefix('create_train_state: ')}") from None
    return state, schedule


def finetune_from(section: Any) -> FineTune | None:
    """The :class:`train.FineTune` the ``finetune`` section describes (None: the run trains every param)."""
    if not section.active:
        return None
    lora = section.lora
    adapters = None if lora.rank is None else LoRA(rank=lora.rank, alpha=lora.alpha, targets=tuple(lora.targets),
                                                   dropout=lora.dropout)
    return FineTune(lora=adapters, freeze=None if section.freeze is None else tuple(section.freeze),
                    base=section.base)


def _init_from(config: Any) -> str | None:
    """``model.init_from``, unless the run's workdir has checkpoints: it resumes from them instead."""
    resuming = checkpoint_steps(os.path.join(os.path.abspath(config.workdir), "checkpoints"))
    return None if resuming else config.model.init_from
