"""What the benchmarks that compile for a GPU without one share: their two choices on the
command line (which models, which policies) and the target's compile-only device."""

from __future__ import annotations

import argparse
import sys
from typing import Any, Iterable

from train.inspections.targets import TargetError, get_target, target_devices, target_slug

__all__ = ["chosen", "target_device", "target_slug"]


def chosen(parser: argparse.ArgumentParser, **choices: tuple[str, Iterable[str]]) -> list[list[str]]:
    """Each ``name=(comma-separated text, known names)`` split, in order; an unknown name
    stops the parser with one line listing them all."""
    picked = [(name, text.split(","), list(known)) for name, (text, known) in choices.items()]
    unknown = [item for _, items, known in picked for item in items if item not in known]
    if unknown:
        parser.error(f"unknown {', '.join(unknown)}; " + "; ".join(f"{name}: {', '.join(known)}"
                                                                   for name, _, known in picked))
    return [items for _, items, _ in picked]


def target_device(name: str) -> tuple[Any, Any] | None:
    """The target ``name`` (``h100``, ``h200``, a target file, ``v5e``, ``v5p``, ``v6e``) and one
    compile-only device of it; None, having said why on stderr (no CUDA plugin or libtpu, an unknown target)."""
    try:
        target = get_target(name)
        return target, target_devices(target)[0]
    except TargetError as e:
        print(f"error: {e}", file=sys.stderr)
        return None
