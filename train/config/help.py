"""``python -m train --help``: every config field with its type, default and meaning
(also ``docs/config.md``, checked against it by the tests)."""

from typing import Any

import yaml
from pydantic import BaseModel

from train.config.fields import CLASS_REFERENCE, model_fields
from train.config.schema import SECTIONS, ExperimentConfig
from train.models import MODELS

__all__ = ["help_text"]


def _yaml(value: Any) -> str:
    value = list(value) if isinstance(value, tuple) else value
    return yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...").strip()


def _type_name(schema: dict) -> str:
    """A JSON schema's type in words."""
    if "anyOf" in schema:
        return " or ".join(_type_name(s) for s in schema["anyOf"])
    if schema.get("type") == "array":
        return f"list of {_type_name(schema['items'])}" if schema.get("items") else "list"
    if "type" not in schema and isinstance(schema.get("const"), str):  # Literal["auto"]: pydantic < 2.7 gives no type
        return "string"
    return {"integer": "integer", "number": "number", "string": "string", "boolean": "true/false",
            "object": "mapping", "null": "null"}.get(schema.get("type"), "any")


def _field_lines(prefix: str, cls: type) -> list[str]:
    """One line per field of a section; a sub-section (``precision.fp8``) expanded after its section's fields."""
    schema = cls.model_json_schema()["properties"]
    lines, nested = [], []
    for name, field in cls.model_fields.items():
        if (prefix, name) == ("model.", "options") or not prefix and name in SECTIONS:
            continue
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            nested.append((f"{prefix}{name}.", field.annotation))
            continue
        lines.append(f"  {prefix}{name:<{33 - len(prefix)}} {_type_name(schema[name]):<16} "
                     f"default {_yaml(field.get_default(call_default_factory=True)):<12} {field.description}")
    for sub_prefix, sub in nested:
        lines += _field_lines(sub_prefix, sub)
    return lines


def help_text() -> str:
    """Every config field with its type, default and meaning, for ``--help``."""
    lines = ["config fields (set in the YAML file or as key=value overrides):", ""]
    for prefix, cls in {"": ExperimentConfig, **{f"{k}.": v for k, v in SECTIONS.items()}}.items():
        lines += _field_lines(prefix, cls)
        lines.append("")
    lines.append("model fields, by model.name (num_classes, vocab_size and block_size default to the data's):")
    for name in MODELS:
        lines.append(f"  {name:<8} " + ", ".join(f"{k}={_yaml(d)}" for k, (_, d) in model_fields(name).items()))
    lines.append(f"  {CLASS_REFERENCE[1]}: any Flax module; every other model.* key is a keyword argument of "
                 f"its constructor (YAML values, mappings allowed)")
    return "\n".join(lines)
