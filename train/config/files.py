"""Reading experiment configs: a YAML file, its ``key=value`` overrides
(:mod:`train.config.overrides`), validated by the schema with pydantic's errors
as one line naming the key; and a config back as plain data."""

import os
import re
from typing import Any

import yaml
from pydantic import ValidationError

from train.config.errors import ConfigError, error_message
from train.config.overrides import apply_overrides
from train.config.schema import DistributedConfig, ExperimentConfig
from train.references import is_reference

__all__ = ["distributed_settings", "from_dict", "load_config", "to_dict", "with_origin"]

_REPOSITORY = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # where configs/ is


def from_dict(raw: Any) -> ExperimentConfig:
    """A validated config from a (YAML-like) dict."""
    try:
        return ExperimentConfig.model_validate({} if raw is None else raw)
    except ValidationError as e:
        raise ConfigError(error_message(e.errors()[0], ExperimentConfig)) from None


def to_dict(config: ExperimentConfig) -> dict:
    """The config as plain data (model options flattened into ``model``)."""
    out = config.model_dump()
    out["model"] = {"name": config.model.name, **({"output": config.model.output} if config.model.output is not None
                                                  else {}),
                    **({"init_from": config.model.init_from} if config.model.init_from is not None else {}),
                    **out["model"]["options"]}
    return out


def load_config(path: str | os.PathLike, overrides: list[str] = ()) -> ExperimentConfig:
    """Reads a YAML config file, applies ``key=value`` overrides and validates.

    Raises:
      ConfigError: one line naming the file, the key and the valid choices.
    """
    path = os.fspath(path)
    try:
        with open(path, encoding="utf-8") as f:
            raw = yaml.safe_load(f)
    except FileNotFoundError:
        shipped = os.path.join(_REPOSITORY, "configs")
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
        raise ConfigError(f"{path}: the top level must be a mapping of keys to values, got {type(raw).__name__}")
    try:
        config = from_dict(_beside(path, apply_overrides(raw, list(overrides))))
    except ConfigError as e:
        raise ConfigError(with_origin(str(e), path, overrides)) from None
    given = {item.partition("=")[0].strip() for item in overrides}
    config.model._origins = {key: "the command line" if {f"model.{key}", f"model.options.{key}"} & given else path
                             for key in config.model.options}
    return config


def load_run_config(run_dir: str | os.PathLike, overrides: list[str] = ()) -> ExperimentConfig:
    """``RUN/config.yaml`` (the resolved config a run wrote: every key, defaults too) read back
    as :func:`load_config` reads it, with ``overrides``. ``data.num_classes`` is written for
    every dataset; it is unset for those that do not read it (all but the synthetic ones,
    :data:`train.data.DATASETS`), whose check would take the default written for a setting."""
    from train.data import DATASETS

    path = os.path.join(os.fspath(run_dir), "config.yaml")
    try:
        with open(path, encoding="utf-8") as f:
            raw = yaml.safe_load(f)
    except (OSError, yaml.YAMLError):
        raw = None  # load_config says what is wrong
    data = raw.get("data") if isinstance(raw, dict) else None
    name = data.get("name") if isinstance(data, dict) else None
    reads = name in DATASETS and "num_classes" in DATASETS[name][1]
    unset = [] if reads or not isinstance(data, dict) or "num_classes" not in data else ["data.num_classes=null"]
    return load_config(path, [*unset, *overrides])


def with_origin(message: str, path: str, overrides: list[str] | tuple[str, ...]) -> str:
    """``message`` (about a config, from loading it or building what it names) after where the key it is about was set: ``the command line
    (key=value)`` for an override, else the config file. The key is the message's
    subject: the override it names, the quoted key of "unknown key '...'", else its
    first word."""
    named = re.match(r"override '([^']*)': (.*)", message, re.S)
    if named:
        return f"the command line ({named.group(1)}): {named.group(2)}"
    quoted = re.match(r"unknown key '([^']+)'", message)
    subject = quoted.group(1) if quoted else message.split(" ", 1)[0].rstrip(":")
    for item in overrides:
        key = item.partition("=")[0].strip()
        if key and (key == subject or key.startswith(subject + ".") or subject.startswith((key + ".", key + "["))):
            shown = item.strip() if len(item.strip()) <= 100 else item.strip()[:96] + " ..."  # a 2,000-item list
            return f"the command line ({shown}): {message}"
    return f"{path}: {message}"


def _beside(config_path: str, raw: dict) -> dict:
    """``raw`` with relative ``file.py:Name`` references that exist next to the
    config file made absolute (the others are left to the working directory)."""
    def rebase(value: Any) -> Any:
        if not (isinstance(value, str) and is_reference(value)):
            return value
        where, _, name = value.strip().rpartition(":")
        beside = os.path.join(os.path.dirname(os.path.abspath(config_path)), where)
        if where.endswith(".py") and not os.path.isabs(where) and os.path.isfile(beside):
            return f"{os.path.normpath(beside)}:{name}"
        return value

    out = dict(raw)
    for section, key in (("model", "name"), ("data", "name"), ("optimizer", "name"), ("optimizer", "schedule")):
        if isinstance(out.get(section), dict) and key in out[section]:
            out[section] = {**out[section], key: rebase(out[section][key])}
    if "task" in out:
        out["task"] = rebase(out["task"])
    return out


def distributed_settings(path: str | os.PathLike, overrides: list[str] = ()) -> DistributedConfig:
    """Only the ``distributed`` section of a config, read without touching a device.

    JAX's multi-process runtime must start before anything initialises a
    device, and validating a whole config does; the CLI reads this first.
    Errors are left to :func:`load_config` (this returns the defaults).
    """
    try:
        with open(os.fspath(path), encoding="utf-8") as f:
            raw = yaml.safe_load(f) or {}
        raw = apply_overrides(raw if isinstance(raw, dict) else {}, list(overrides))
        return DistributedConfig.model_validate(raw.get("distributed") or {})
    except (OSError, yaml.YAMLError, ConfigError, ValidationError):
        return DistributedConfig()
