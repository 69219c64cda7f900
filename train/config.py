"""The experiment schema: typed sections, YAML loading, ``key=value`` overrides,
validation that fails before any compute with one clear paragraph.

A config file is YAML with the sections ``model``, ``data``, ``optimizer`` and
``precision`` plus top-level run settings; every field has a default, so a file
only says what differs. ``python -m train --help`` lists every field.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import difflib
import os
import types
import typing
from typing import Any

import jax.numpy as jnp
import numpy as np
import yaml

import precision
from train.data import DATASETS
from train.models import MODELS

__all__ = ["ConfigError", "ExperimentConfig", "ModelConfig", "DataConfig", "OptimizerConfig",
           "PrecisionConfig", "MeshConfig", "DistributedConfig", "OPTIMIZERS", "SCHEDULES", "INFERENCE_DTYPES", "load_config", "from_dict",
           "to_dict", "apply_overrides", "help_text"]

OPTIMIZERS = ("adam", "adamw", "sgd", "lion")
SCHEDULES = ("constant", "cosine", "linear")
INFERENCE_DTYPES = ("float16", "bfloat16")


class ConfigError(ValueError):
    """An experiment config is invalid; the message names the file, the key and the valid choices."""


def _field(default: Any, help: str, **kwargs: Any) -> Any:
    if isinstance(default, (list, dict)):
        return dataclasses.field(default_factory=lambda: type(default)(default), metadata={"help": help})
    return dataclasses.field(default=default, metadata={"help": help}, **kwargs)


@dataclasses.dataclass
class ModelConfig:
    """``name`` picks the model; every other key is a field of that model class."""

    name: str = _field("mlp", f"model: {', '.join(MODELS)}")
    options: dict = _field({}, "the model's own fields (listed below per model)")


@dataclasses.dataclass
class DataConfig:
    name: str = _field("digits", f"dataset: {', '.join(DATASETS)}")
    path: str | None = _field(None, "your own files: Fashion-MNIST IDX directory or a text file")
    batch_size: int = _field(128, "examples per micro-batch; a step sees batch_size * accum_steps")
    eval_batch_size: int = _field(512, "examples per eval batch")
    eval_batches: int | None = _field(None, "evaluate on at most this many batches (null: all)")
    seq_len: int = _field(128, "characters per training window (text datasets)")
    val_fraction: float = _field(0.1, "tail of the text held out for validation (text datasets)")
    num_train: int = _field(4096, "training examples (synthetic datasets)")
    num_test: int = _field(1024, "test examples (synthetic datasets)")
    input_shape: list[int] = _field([32], "shape of one input (synthetic)")
    num_classes: int = _field(10, "classes, or vocabulary size for synthetic_text (synthetic datasets)")
    prefetch: int = _field(2, "batches kept in flight to the device (0: none)")


@dataclasses.dataclass
class OptimizerConfig:
    name: str = _field("adamw", f"optimizer: {', '.join(OPTIMIZERS)}")
    lr: float = _field(1e-3, "peak learning rate")
    schedule: str = _field("constant", f"learning-rate schedule after warmup: {', '.join(SCHEDULES)}")
    warmup_steps: int = _field(0, "linear warmup from 0 over this many steps")
    min_lr: float = _field(0.0, "final learning rate of the cosine and linear schedules")
    weight_decay: float = _field(0.0, "decoupled weight decay (adamw, lion, sgd)")
    b1: float = _field(0.9, "first-moment decay (adam, adamw, lion)")
    b2: float = _field(0.999, "second-moment decay (adam, adamw, lion)")
    eps: float = _field(1e-8, "denominator epsilon (adam, adamw)")
    momentum: float = _field(0.9, "momentum (sgd; 0 for none)")
    nesterov: bool = _field(False, "Nesterov momentum (sgd)")
    max_grad_norm: float | None = _field(None, "clip unscaled gradients to this global norm (null: off)")


@dataclasses.dataclass
class PrecisionConfig:
    policy: str = _field("fp32", f"policy string or preset ({', '.join(precision.PRESETS)})")
    rules: list | None = _field(None, "per-module rules [[pattern, policy], ...]; null: the preset's "
                                      "(norms in f32; O1 adds softmax)")
    loss_scale: str = _field("auto", f"{', '.join(precision.LOSS_SCALE_KINDS)} "
                                     "(auto: dynamic for float16, none otherwise)")
    initial_scale: float = _field(2.0 ** 15, "initial (or static) loss scale")
    growth_interval: int = _field(2000, "finite steps before a dynamic scale grows")
    growth_factor: float = _field(2.0, "dynamic scale growth factor")
    backoff_factor: float = _field(0.5, "dynamic scale back-off factor")
    min_scale: float = _field(1.0, "smallest dynamic loss scale")
    max_scale: float = _field(2.0 ** 24, "largest dynamic loss scale")
    hysteresis: int = _field(1, "consecutive non-finite steps before backing off")
    skip_with: str = _field("auto", f"how non-finite steps are skipped: {', '.join(precision.optim.SKIP_STRATEGIES)}")
    autocast: bool = _field(True, "rewrite every op of the model to the policy, whatever dtypes its layers pin "
                                  "(false: cast only at module boundaries)")
    allow: list[str] = _field([], "primitives added to the allow list (run in the compute dtype), e.g. [exp]")
    deny: list[str] = _field([], "primitives added to the deny list (run in float32), e.g. [tanh]")
    follow: list[str] = _field([], "primitives removed from both lists (follow their inputs)")
    strict: bool = _field(False, "fail, instead of warning, when the policy leaves more than 5% of the "
                                 "model's matmul/conv FLOPs in float32")


@dataclasses.dataclass
class MeshConfig:
    data: int = _field(-1, "devices the batch is split over (-1: all devices that fsdp leaves)")
    fsdp: int = _field(1, "devices params and optimizer state are split over (FSDP); the batch is split "
                          "over them too")
    fsdp_min_size: int = _field(1024, "arrays with fewer elements stay replicated under fsdp")


@dataclasses.dataclass
class DistributedConfig:
    coordinator_address: str | None = _field(None, "host:port of process 0 for a multi-process run (or env "
                                                   "JAX_COORDINATOR_ADDRESS); null: single process")
    num_processes: int | None = _field(None, "processes in the run (or env JAX_NUM_PROCESSES)")
    process_id: int | None = _field(None, "this process's index, 0 .. num_processes-1 (or env JAX_PROCESS_ID)")
    cluster_detect: bool = _field(False, "let JAX detect the cluster (SLURM, Open MPI, Kubernetes, TPU)")
    timeout_seconds: int = _field(300, "how long processes wait for each other to start")


@dataclasses.dataclass
class ExperimentConfig:
    seed: int = _field(0, "seed of params, dropout and data order")
    workdir: str = _field("runs/default", "where metrics, config, checkpoints and TensorBoard files go")
    steps: int = _field(1000, "optimizer steps to train to (a larger value continues a finished run)")
    accum_steps: int = _field(1, "micro-batches accumulated per optimizer step")
    log_every: int = _field(50, "steps between metrics records")
    eval_every: int = _field(0, "steps between evaluations (0: only at the end)")
    checkpoint_every: int = _field(500, "steps between checkpoints (0: only at the end)")
    keep_checkpoints: int = _field(3, "checkpoints kept")
    max_nonfinite_steps: int = _field(100, "stop after this many consecutive non-finite steps at the "
                                           "minimum loss scale")
    inference_dtypes: list[str] = _field(list(INFERENCE_DTYPES), "half dtypes whose inference accuracy is "
                                                                 "compared with float32 at the end ([] to skip)")
    progress: bool = _field(True, "show a progress bar")
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
    precision: PrecisionConfig = dataclasses.field(default_factory=PrecisionConfig)
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
    distributed: DistributedConfig = dataclasses.field(default_factory=DistributedConfig)


_SECTIONS = {"model": ModelConfig, "data": DataConfig, "optimizer": OptimizerConfig,
             "precision": PrecisionConfig, "mesh": MeshConfig, "distributed": DistributedConfig}


# ----------------------------------------------------------------------------- types


_UNIONS = (typing.Union, types.UnionType)
_SEQUENCES = (list, tuple, typing.Sequence, collections.abc.Sequence)


def _type_name(tp: Any) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in _UNIONS:
        names = [_type_name(a) for a in args if a is not type(None)]
        return " or ".join(names) + (" or null" if type(None) in args else "")
    if origin in _SEQUENCES:
        return f"list of {_type_name(args[0])}" if args else "list"
    return {int: "integer", float: "number", str: "string", bool: "true/false", dict: "mapping",
            list: "list"}.get(tp, getattr(tp, "__name__", str(tp)))


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """``value`` as type ``tp``; raises ``ConfigError`` naming ``key``."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)

    def fail():
        name = _type_name(tp)
        article = "" if name.startswith(("true", "list")) else ("an " if name[0] in "aeiou" else "a ")
        raise ConfigError(f"{key} must be {article}{name}, got {value!r}")

    if origin in _UNIONS:
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, key)
            except ConfigError:
                pass
        fail()
    if origin in _SEQUENCES:
        if not isinstance(value, (list, tuple)):
            fail()
        return [_coerce(v, args[0], f"{key}[{i}]") for i, v in enumerate(value)] if args else list(value)
    if tp is bool:
        if not isinstance(value, bool):
            fail()
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            fail()
        return value
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads 1e-3 as a string
            try:
                value = float(value)
            except ValueError:
                fail()
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            fail()
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            fail()
        return value
    if tp in (list, dict):
        if not isinstance(value, tp):
            fail()
        return value
    return value


def _unknown(key: str, valid: list[str]) -> ConfigError:
    close = difflib.get_close_matches(key.rsplit(".", 1)[-1], valid, n=1)
    prefix = key.rsplit(".", 1)[0] + "." if "." in key else ""
    hint = f" Did you mean '{prefix}{close[0]}'?" if close else ""
    return ConfigError(f"unknown key '{key}'.{hint} Valid keys here: "
                       f"{', '.join(prefix + v for v in valid)}")


def model_fields(name: str) -> dict[str, tuple[Any, Any]]:
    """The configurable fields of model ``name``: ``{field: (type, default)}``."""
    cls = MODELS[name]
    hints = typing.get_type_hints(cls)
    return {f.name: (hints.get(f.name, Any), f.default) for f in dataclasses.fields(cls)
            if f.name not in ("parent", "name") and f.init}


def _section(cls: type, raw: Any, where: str) -> Any:
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{where} must be a mapping of keys to values, got {raw!r}")
    if cls is ModelConfig:
        return _model_section(raw, where)
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in raw.items():
        full = f"{where}.{key}" if where else str(key)
        if key not in names:
            raise _unknown(full, names)
        if key in _SECTIONS and cls is ExperimentConfig:
            kwargs[key] = _section(_SECTIONS[key], value, key)
        else:
            kwargs[key] = _coerce(value, hints[key], full)
    return cls(**kwargs)


def _model_section(raw: dict, where: str) -> ModelConfig:
    name = _coerce(raw.get("name", ModelConfig.name), str, f"{where}.name")
    if name not in MODELS:
        raise ConfigError(f"{where}.name: unknown model {name!r}; valid: {', '.join(MODELS)}")
    fields = model_fields(name)
    options = {}
    for key, value in raw.items():
        if key == "name":
            continue
        if key not in fields:
            raise _unknown(f"{where}.{key}", ["name"] + list(fields))
        options[key] = _coerce(value, fields[key][0], f"{where}.{key}")
        if key == "dtype" and value is not None:
            _check_float_dtype(value, f"{where}.{key}")
    return ModelConfig(name=name, options=options)


def _check_float_dtype(value: Any, where: str) -> None:
    valid = "float32, bfloat16, float16 (or null)"
    try:
        ok = np.issubdtype(jnp.dtype(value), np.floating)
    except TypeError:
        ok = False
    if not ok:
        raise ConfigError(f"{where}: {value!r} is not a floating dtype; valid: {valid}")


# ----------------------------------------------------------------------------- loading


def from_dict(raw: Any) -> ExperimentConfig:
    """A validated config from a (YAML-like) dict."""
    if raw is None:
        raw = {}
    config = _section(ExperimentConfig, raw, "")
    _validate(config)
    return config


def to_dict(config: ExperimentConfig) -> dict:
    """The config as plain data (model options flattened into ``model``)."""
    out = dataclasses.asdict(config)
    out["model"] = {"name": config.model.name, **config.model.options}
    return out


def _set_dotted(raw: dict, key: str, value: Any) -> None:
    parts = key.split(".")
    node = raw
    for part in parts[:-1]:
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise ConfigError(f"cannot set '{key}': '{part}' is not a section")
        node = child
    node[parts[-1]] = value


def apply_overrides(raw: dict, overrides: list[str]) -> dict:
    """Applies ``key=value`` overrides (dotted keys, YAML values) to a raw config dict."""
    raw = {k: (dict(v) if isinstance(v, dict) else v) for k, v in raw.items()}  # overrides never edit the caller's
    for item in overrides:
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError(f"override {item!r} is not of the form key=value (e.g. optimizer.lr=3e-4)")
        try:
            value = yaml.safe_load(text) if text.strip() else None
        except yaml.YAMLError as e:
            raise ConfigError(f"override {item!r}: value is not valid YAML ({e.problem})") from None
        top = key.split(".")[0]
        valid = [f.name for f in dataclasses.fields(ExperimentConfig)]
        if top not in valid:
            raise _unknown(key, valid)
        if top not in _SECTIONS and "." in key:
            raise ConfigError(f"override {item!r}: '{top}' is a value, not a section")
        if top in _SECTIONS and "." not in key:
            raise ConfigError(f"override {item!r}: '{top}' is a section; set one of its keys, "
                              f"e.g. {top}.name=...")
        _set_dotted(raw, key, value)
    return raw


def load_config(path: str | os.PathLike, overrides: list[str] = ()) -> ExperimentConfig:
    """Reads a YAML config file, applies ``key=value`` overrides and validates.

    Raises:
      ConfigError: with one paragraph naming the file, the key and the valid choices.
    """
    path = os.fspath(path)
    try:
        with open(path, encoding="utf-8") as f:
            raw = yaml.safe_load(f)
    except FileNotFoundError:
        shipped = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")
        listing = sorted(n for n in os.listdir(shipped) if n.endswith(".yaml")) if os.path.isdir(shipped) else []
        hint = f" Shipped configs in {shipped}: {', '.join(listing)}." if listing else ""
        raise ConfigError(f"config file {path} not found.{hint}") from None
    except IsADirectoryError:
        raise ConfigError(f"config path {path} is a directory; give a .yaml file") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError(f"{path}: not valid YAML{where}: {getattr(e, 'problem', e)}") from None
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of keys to values, got "
                          f"{type(raw).__name__}")
    try:
        return from_dict(apply_overrides(raw, list(overrides)))
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None


def distributed_settings(path: str | os.PathLike, overrides: list[str] = ()) -> DistributedConfig:
    """Only the ``distributed`` section of a config, read without touching JAX.

    JAX's multi-process runtime must start before anything initialises a
    device, and validating a whole config does; the CLI reads this first.
    Errors are left to :func:`load_config`.
    """
    try:
        with open(os.fspath(path), encoding="utf-8") as f:
            raw = yaml.safe_load(f) or {}
        raw = apply_overrides(raw if isinstance(raw, dict) else {}, list(overrides))
        return _section(DistributedConfig, raw.get("distributed"), "distributed")
    except (OSError, yaml.YAMLError, ConfigError):
        return DistributedConfig()


# ----------------------------------------------------------------------------- validation


def _validate(c: ExperimentConfig) -> None:
    def positive(key: str, value: Any, minimum: float = 1) -> None:
        if value < minimum:
            raise ConfigError(f"{key} must be >= {minimum:g}, got {value}")

    for key in ("steps", "accum_steps", "log_every", "keep_checkpoints", "max_nonfinite_steps"):
        positive(key, getattr(c, key))
    for key in ("eval_every", "checkpoint_every", "seed"):
        positive(key, getattr(c, key), 0)
    for key in ("batch_size", "eval_batch_size", "seq_len", "num_train", "num_test", "num_classes"):
        positive(f"data.{key}", getattr(c.data, key))
    positive("data.prefetch", c.data.prefetch, 0)
    if c.data.eval_batches is not None:
        positive("data.eval_batches", c.data.eval_batches)
    if not 0 < c.data.val_fraction < 1:
        raise ConfigError(f"data.val_fraction must lie in (0, 1), got {c.data.val_fraction}")
    if c.data.name not in DATASETS:
        raise ConfigError(f"data.name: unknown dataset {c.data.name!r}; valid: {', '.join(DATASETS)}")
    for key, valid in (("name", OPTIMIZERS), ("schedule", SCHEDULES)):
        if getattr(c.optimizer, key) not in valid:
            raise ConfigError(f"optimizer.{key}: unknown value {getattr(c.optimizer, key)!r}; "
                              f"valid: {', '.join(valid)}")
    if c.optimizer.lr <= 0:
        raise ConfigError(f"optimizer.lr must be > 0, got {c.optimizer.lr}")
    positive("optimizer.warmup_steps", c.optimizer.warmup_steps, 0)
    if c.optimizer.max_grad_norm is not None and c.optimizer.max_grad_norm <= 0:
        raise ConfigError(f"optimizer.max_grad_norm must be > 0 or null, got {c.optimizer.max_grad_norm}")
    for dtype in c.inference_dtypes:
        if dtype not in INFERENCE_DTYPES:
            raise ConfigError(f"inference_dtypes: unknown dtype {dtype!r}; valid: {', '.join(INFERENCE_DTYPES)}")
    _validate_precision(c.precision)
    if c.mesh.data < 1 and c.mesh.data != -1:
        raise ConfigError(f"mesh.data must be >= 1, or -1 for all devices, got {c.mesh.data}")
    positive("mesh.fsdp", c.mesh.fsdp)
    positive("mesh.fsdp_min_size", c.mesh.fsdp_min_size, 0)
    d = c.distributed
    if d.num_processes is not None:
        positive("distributed.num_processes", d.num_processes)
    if d.process_id is not None:
        positive("distributed.process_id", d.process_id, 0)
        if d.num_processes is not None and d.process_id >= d.num_processes:
            raise ConfigError(f"distributed.process_id must be < distributed.num_processes={d.num_processes}, "
                              f"got {d.process_id}")
    positive("distributed.timeout_seconds", d.timeout_seconds)
    if d.coordinator_address is not None and not _is_host_port(d.coordinator_address):
        raise ConfigError(f"distributed.coordinator_address must be host:port (e.g. 10.0.0.1:1234), got "
                          f"{d.coordinator_address!r}")


def _validate_precision(p: PrecisionConfig) -> None:
    try:
        precision.get_policy(p.policy)
    except precision.PolicyError as e:
        raise ConfigError(f"precision.policy: {e}") from None
    if p.rules is not None:
        try:
            precision.rules.as_rules(p.rules)
        except (TypeError, precision.PolicyError) as e:
            raise ConfigError(f"precision.rules: {str(e).rstrip('.')}. Write rules as [[pattern, policy], ...], e.g. "
                              f"[[LayerNorm, f32], [Softmax, f32]]") from None
    if p.skip_with not in precision.optim.SKIP_STRATEGIES:
        raise ConfigError(f"precision.skip_with: unknown value {p.skip_with!r}; valid: "
                          f"{', '.join(precision.optim.SKIP_STRATEGIES)}")
    build_loss_scale(p)
    build_op_lists(p)


def build_op_lists(p: PrecisionConfig) -> precision.OpLists | None:
    """The autocast op lists the precision section describes (None: the defaults)."""
    if not (p.allow or p.deny or p.follow):
        return None
    try:
        return precision.op_lists(allow=p.allow, deny=p.deny, follow=p.follow)
    except (TypeError, precision.PolicyError) as e:
        raise ConfigError(f"precision.allow/deny/follow: {e}") from None


def _is_host_port(address: str) -> bool:
    host, sep, port = address.rpartition(":")
    return bool(sep and host and port.isdigit() and 0 < int(port) < 65536)


def build_loss_scale(p: PrecisionConfig) -> precision.LossScale:
    """The loss scale the precision section describes."""
    kind = p.loss_scale.strip().lower()
    if kind not in precision.LOSS_SCALE_KINDS:
        raise ConfigError(f"precision.loss_scale: unknown value {p.loss_scale!r}; valid: "
                          f"{', '.join(precision.LOSS_SCALE_KINDS)}")
    if kind == "auto":
        auto = precision.get_loss_scale("auto", p.policy)
        kind = "dynamic" if isinstance(auto, precision.DynamicLossScale) else "none"
    try:
        if kind == "dynamic":
            return precision.DynamicLossScale(
                p.initial_scale, period=p.growth_interval, factor=p.growth_factor,
                min_loss_scale=p.min_scale, backoff_factor=p.backoff_factor, max_loss_scale=p.max_scale,
                hysteresis=p.hysteresis)
        return precision.get_loss_scale(kind, p.policy, initial_scale=p.initial_scale)
    except ValueError as e:
        names = {"period": "growth_interval", "factor": "growth_factor", "min_loss_scale": "min_scale",
                 "max_loss_scale": "max_scale", "loss_scale": "initial_scale", "DynamicLossScale: ": ""}
        message = str(e)
        for old, new in names.items():
            message = message.replace(old, new)
        raise ConfigError(f"precision: {message}") from None


# ----------------------------------------------------------------------------- help


def help_text() -> str:
    """Every config field with its type, default and meaning, for ``--help``."""
    lines = ["config fields (set in the YAML file or as key=value overrides):", ""]

    def describe(cls: type, prefix: str) -> None:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if f.name in _SECTIONS and cls is ExperimentConfig:
                continue
            if cls is ModelConfig and f.name == "options":
                continue
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            lines.append(f"  {prefix}{f.name:<{33 - len(prefix)}} {_type_name(hints[f.name]):<16} "
                         f"default {yaml.safe_dump(default, default_flow_style=True).strip().removesuffix('...').strip():<12} "
                         f"{f.metadata.get('help', '')}")

    describe(ExperimentConfig, "")
    for name, cls in _SECTIONS.items():
        lines.append("")
        describe(cls, name + ".")
    lines += ["", "model fields, by model.name (num_classes, vocab_size and block_size default to the data's):"]
    for name in MODELS:
        fields = ", ".join(f"{k}={yaml.safe_dump(list(d) if isinstance(d, tuple) else d, default_flow_style=True).strip().removesuffix('...').strip()}"
                           for k, (_, d) in model_fields(name).items())
        lines.append(f"  {name:<8} {fields}")
    return "\n".join(lines)
