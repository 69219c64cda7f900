"""Reading experiment configs: YAML files, dotted ``key=value`` overrides,
pydantic's errors as one line naming the key, and the ``--help`` listing.

The schema itself (the typed sections) is :mod:`train.config`.
"""

import copy
import os
from typing import Any

import yaml
from pydantic import ValidationError

from train.config import (_SECTIONS, CLASS_REFERENCE, ConfigError, DistributedConfig, ExperimentConfig,
                          is_reference, model_fields)
from train.config_errors import error_message, unknown_key
from train.models import MODELS

__all__ = ["apply_overrides", "distributed_settings", "from_dict", "help_text", "load_config", "to_dict"]


# ----------------------------------------------------------------------------- loading


def from_dict(raw: Any) -> ExperimentConfig:
    """A validated config from a (YAML-like) dict."""
    try:
        return ExperimentConfig.model_validate({} if raw is None else raw)
    except ValidationError as e:
        raise ConfigError(error_message(e.errors()[0], ExperimentConfig)) from None


def to_dict(config: ExperimentConfig) -> dict:
    """The config as plain data (model options flattened into ``model``)."""
    out = config.model_dump()
    out["model"] = {"name": config.model.name, **out["model"]["options"]}
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
    """Applies ``key=value`` overrides (dotted keys, YAML values) to a copy of a raw config dict."""
    raw = copy.deepcopy(raw)
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
        if top not in ExperimentConfig.model_fields:
            raise ConfigError(f"override {item!r}: {unknown_key((top,), ExperimentConfig)}")
        if top not in _SECTIONS and "." in key:
            raise ConfigError(f"override {item!r}: '{top}' is a value, not a section")
        if top in _SECTIONS and "." not in key:
            raise ConfigError(f"override {item!r}: '{top}' is a section; set one of its keys, e.g. {top}.name=...")
        _set_dotted(raw, key, value)
    return raw


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
        raise ConfigError(f"{path}: the top level must be a mapping of keys to values, got {type(raw).__name__}")
    try:
        return from_dict(_beside(path, apply_overrides(raw, list(overrides))))
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None


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
    for section in ("model", "data"):
        if isinstance(out.get(section), dict) and "name" in out[section]:
            out[section] = {**out[section], "name": rebase(out[section]["name"])}
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


# ----------------------------------------------------------------------------- help


def _yaml(value: Any) -> str:
    value = list(value) if isinstance(value, tuple) else value
    return yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...").strip()


def _type_name(schema: dict) -> str:
    """A JSON schema's type in words."""
    if "anyOf" in schema:
        return " or ".join(_type_name(s) for s in schema["anyOf"])
    if schema.get("type") == "array":
        return f"list of {_type_name(schema['items'])}" if schema.get("items") else "list"
    return {"integer": "integer", "number": "number", "string": "string", "boolean": "true/false",
            "object": "mapping", "null": "null"}.get(schema.get("type"), "any")


def help_text() -> str:
    """Every config field with its type, default and meaning, for ``--help``."""
    lines = ["config fields (set in the YAML file or as key=value overrides):", ""]
    for prefix, cls in {"": ExperimentConfig, **{f"{k}.": v for k, v in _SECTIONS.items()}}.items():
        schema = cls.model_json_schema()["properties"]
        for name, field in cls.model_fields.items():
            if (prefix, name) == ("model.", "options") or not prefix and name in _SECTIONS:
                continue
            lines.append(f"  {prefix}{name:<{33 - len(prefix)}} {_type_name(schema[name]):<16} "
                         f"default {_yaml(field.get_default(call_default_factory=True)):<12} {field.description}")
        lines.append("")
    lines.append("model fields, by model.name (num_classes, vocab_size and block_size default to the data's):")
    for name in MODELS:
        lines.append(f"  {name:<8} " + ", ".join(f"{k}={_yaml(d)}" for k, (_, d) in model_fields(name).items()))
    lines.append(f"  {CLASS_REFERENCE[1]}: any Flax module; every other model.* key is a keyword argument of "
                 f"its constructor (YAML values, mappings allowed)")
    return "\n".join(lines)
