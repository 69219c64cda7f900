"""A verified change as an experiment config says it: a YAML mapping to paste into a
config file, and the same as ``key=value`` overrides for the command line.

Both are checked by parsing (``yaml.safe_load`` and the config loader): values are
written in YAML's flow style, quoting what YAML would read otherwise (a rule
pattern ``*norm*`` is an alias to YAML, ``p=f32,c=bf16`` a list in a flow sequence).
"""

from __future__ import annotations

import json
import re
from typing import Any

__all__ = ["config_text"]

_PLAIN = re.compile(r"[A-Za-z_][A-Za-z0-9_./=-]*")
_RESERVED = {"true", "false", "yes", "no", "on", "off", "null", "y", "n"}


def _flow(value: Any) -> str:
    """``value`` in YAML's flow style (strings bare where YAML reads them back as the same string)."""
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_flow(v) for v in value) + "]"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    if isinstance(value, (int, float)):
        return repr(value)
    text = str(value)
    return text if _PLAIN.fullmatch(text) and text.lower() not in _RESERVED else json.dumps(text)


def config_text(**precision: Any) -> tuple[str, tuple[str, ...]]:
    """(a YAML mapping of the ``precision`` section's keys, the command line's overrides)."""
    yaml_text = "\n".join(["precision:", *(f"  {key}: {_flow(value)}" for key, value in precision.items())])
    return yaml_text, tuple(f"precision.{key}={_flow(value)}" for key, value in precision.items())
