"""Names for the leaves of a pytree (``params/Dense_0/kernel``), shared by
checkpoints, error messages and metrics that point at one array."""

from __future__ import annotations

from typing import Any

import jax


def leaf_names(tree: Any) -> list[str]:
    """``a/b/0``-style paths of a tree's leaves, in leaf order."""
    return [jax.tree_util.keystr(path, simple=True, separator="/")
            for path, _ in jax.tree_util.tree_leaves_with_path(tree)]


def leaf_shapes(tree: Any) -> dict[str, tuple[int, ...]]:
    """``{path: shape}`` of a tree's leaves (arrays, abstract arrays or their metadata)."""
    return {name: tuple(getattr(x, "shape", ()) or ())
            for name, x in zip(leaf_names(tree), jax.tree_util.tree_leaves(tree))}
