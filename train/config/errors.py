"""Config errors: pydantic's validation errors as one line naming the dotted key,
the expected type or the valid choices, and the nearest valid key."""

import difflib
import typing
from typing import Any

from pydantic import BaseModel
from pydantic_core import PydanticCustomError

__all__ = ["ConfigError", "error_message", "invalid", "unknown_key"]


class ConfigError(ValueError):
    """An experiment config is invalid; the message names the file, the key and the valid choices."""


def invalid(message: str) -> PydanticCustomError:
    """A validator's error; ``message`` is complete (it names its key) and reaches the user as is."""
    return PydanticCustomError("config", message)


_TYPE_NAMES = {"int_type": "an integer", "float_type": "a number", "string_type": "a string",
               "bool_type": "true/false", "list_type": "a list", "sequence_str": "a list", "dict_type": "a mapping",
               "model_type": "a mapping of keys to values", "is_instance_of": "a list"}
_BOUNDS = {"greater_than": (">", "gt"), "greater_than_equal": (">=", "ge"), "less_than": ("<", "lt"),
           "less_than_equal": ("<=", "le")}


def _dotted(loc: tuple) -> str:
    parts = list(loc)
    if parts[:2] == ["model", "options"]:
        del parts[1]  # model options are written flat, next to model.name
    return "".join(f"[{p}]" if isinstance(p, int) else f".{p}" if i else str(p) for i, p in enumerate(parts))


def _level(root: type, loc: tuple) -> Any:
    """The annotation at ``loc`` below the pydantic model ``root`` (None past a list item or mapping key)."""
    for part in loc:
        fields = getattr(root, "model_fields", {})
        if part not in fields:
            return None
        root = fields[part].annotation
    return root


def unknown_key(loc: tuple, level: type[BaseModel]) -> str:
    valid = list(level.model_fields)
    prefix = _dotted(loc[:-1]) + "." if loc[:-1] else ""
    close = difflib.get_close_matches(str(loc[-1]), valid, n=1)
    hint = f" Did you mean '{prefix}{close[0]}'?" if close else ""
    return f"unknown key '{prefix}{loc[-1]}'.{hint} Valid keys here: {', '.join(prefix + v for v in valid)}"


def error_message(error: dict, root: type[BaseModel], prefix: tuple = ()) -> str:
    """One line for one of pydantic's errors at ``prefix + error['loc']``; ``loc`` is relative to ``root``."""
    kind, loc, value, ctx = error["type"], tuple(error["loc"]), error.get("input"), error.get("ctx", {})
    key = _dotted(prefix + loc) or "the config"
    if kind == "config":
        return error["msg"]
    if kind == "extra_forbidden":
        return unknown_key(prefix + loc, _level(root, loc[:-1]))
    if kind == "invalid_key" or loc[-1:] == ("[key]",):  # the input is the key
        where = _dotted(prefix + (loc[:-1] if kind == "invalid_key" else loc[:-2])) or "the config"
        return f"{where}: keys must be strings, got {value!r}"
    if kind == "literal_error":
        return f"{key}: unknown value {value!r}; valid: {ctx['expected'].replace(chr(39), '').replace(' or ', ', ')}"
    if kind in ("string_too_short", "string_pattern_mismatch"):
        return f"{key} must not be empty, got {value!r}"
    if kind == "finite_number":
        return f"{key} must be a finite number, got {value!r}"
    if kind in _BOUNDS:
        op, name = _BOUNDS[kind]
        return f"{key} must be {op} {ctx[name]:g}, got {value!r}"
    if kind in _TYPE_NAMES:
        field = getattr(_level(root, loc[:-1]), "model_fields", {}).get(loc[-1]) if loc else None
        if value is None and field is not None and field.is_required():  # null unsets a key: this one has no default
            return f"{key} is required and cannot be null (unset); it must be {_TYPE_NAMES[kind]}"
        nullable = type(None) in typing.get_args(_level(root, loc))
        return f"{key} must be {_TYPE_NAMES[kind]}{' or null' if nullable else ''}, got {value!r}"
    return f"{key}: {error['msg']}"
