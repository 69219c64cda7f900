"""``key=value`` overrides of a config: dotted keys, YAML values; ``key=null`` unsets a key,
an empty value (``workdir=``, most often an empty shell variable) is refused.

A ``model.name`` naming another model than the file's replaces the file's model:
the file's other ``model.*`` keys were written for its model and are dropped
(``model.*`` overrides given on the command line still apply).
"""

import copy
from typing import Any

import yaml

from train.config.errors import ConfigError, unknown_key
from train.config.schema import SECTIONS, ExperimentConfig, ModelConfig

__all__ = ["apply_overrides"]


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
    """Applies ``key=value`` overrides (dotted keys, YAML values) to a copy of a raw config
    dict; a ``model.name`` of another model drops the file's other ``model.*`` keys."""
    raw = copy.deepcopy(raw)
    file_model = raw.get("model") if isinstance(raw.get("model"), dict) else {}
    file_model_name = file_model.get("name", ModelConfig.model_fields["name"].default)
    given: list[str] = []
    for item in overrides:
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError(f"override {item!r} is not of the form key=value (e.g. optimizer.lr=3e-4)")
        if not text.strip():  # not an unset (key=null is): a value that went missing
            raise ConfigError(f"override {item!r}: {key} has an empty value (an empty shell variable, as in "
                              f"{key}=$RUN?): give it a value, or {key}=null to unset it")
        try:
            value = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise ConfigError(f"override {item!r}: value is not valid YAML ({e.problem})") from None
        top = key.split(".")[0]
        if top not in ExperimentConfig.model_fields:
            raise ConfigError(f"override {item!r}: {unknown_key((top,), ExperimentConfig)}")
        if top not in SECTIONS and "." in key:
            raise ConfigError(f"override {item!r}: '{top}' is a value, not a section")
        if top in SECTIONS and "." not in key:
            raise ConfigError(f"override {item!r}: '{top}' is a section; set one of its keys, e.g. {top}.name=...")
        if key == "model.name" and value != file_model_name and isinstance(raw.get("model"), dict):
            for name in [k for k in raw["model"] if k != "name"]:
                if not any(g == f"model.{name}" or g.startswith(f"model.{name}.") for g in given):
                    del raw["model"][name]  # the file's, meant for its own model
        _set_dotted(raw, key, value)
        given.append(key)
    return raw
