"""A tensor-parallel plan: which dimension of each param the mesh's ``tensor`` axis splits,
and why the others are not split.

The plan is data (hashable, so a :class:`~train.parallel.distributed.Layout` holding it
stays a static argument of a jitted step): params are named by their path in the params
tree (``("block_0", "attn", "qkv", "kernel")``), and a tree holding params (masters,
optimizer moments) finds each one by the longest param path its own path ends with
(:meth:`TensorPlan.dim`), with the same shape.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

__all__ = ["Split", "Kept", "TensorPlan", "key_names"]

#: What a split param is to the program: the first half of a matmul pair (its output features
#: split), the second (its input features: each device holds a partial sum), a bias or scale of
#: split features, a vocabulary (embedding table or head), or a rule's choice.
ROLES = ("column", "row", "feature", "vocabulary", "rule")


@dataclasses.dataclass(frozen=True)
class Split:
    """A param split along ``dim`` by the ``tensor`` axis (None: whole over it, by a rule).
    ``spec``: a rule's layout of every dimension (mesh axis names or None), instead of
    ``fsdp`` taking the last dimension it divides."""

    path: tuple[str, ...]
    dim: int | None
    role: str  # one of ROLES
    module: str = ""  # the module path of the op that reads it, as the program names it
    shape: tuple[int, ...] = ()
    spec: tuple | None = None
    parts: int = 1  # a fused matmul's parts (q, k, v): kept interleaved where the model reads it

    def describe(self) -> str:
        where = f"dim {self.dim} split" if self.dim is not None else "whole over tensor"
        by = f" (sharding.rules: {list(self.spec)})" if self.spec is not None else f" in {self.module}" * bool(self.module)
        fused = f" ({self.parts} fused parts)" if self.parts > 1 else ""
        return f"{'/'.join(self.path)} {list(self.shape)}: {self.role}{fused}, {where}{by}"


@dataclasses.dataclass(frozen=True)
class Kept:
    """A param the ``tensor`` axis leaves whole (it stays under ``fsdp``), and why."""

    path: tuple[str, ...]
    why: str
    shape: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True)
class TensorPlan:
    """The splits of a model's params over ``tensor`` devices, and the params left whole."""

    tensor: int
    splits: tuple[Split, ...] = ()
    kept: tuple[Kept, ...] = ()

    @functools.cached_property
    def _by_path(self) -> dict[tuple[str, ...], Split]:
        return {s.path: s for s in self.splits}

    def split_of(self, keys: tuple[str, ...], shape: tuple[int, ...]) -> Split | None:
        """The split of the param whose path ``keys`` ends with (the longest such path), if the
        shapes agree: ``keys`` may be a param's own path or a path into a tree holding params
        (``opt_state/.../mu/block_0/attn/qkv/kernel``)."""
        for start in range(len(keys)):
            split = self._by_path.get(tuple(keys[start:]))
            if split is not None:
                return split if tuple(shape) == split.shape or not split.shape else None
        return None

    def dim(self, keys: tuple[str, ...], shape: tuple[int, ...]) -> int | None:
        """The dimension the ``tensor`` axis splits, for the leaf at ``keys`` of ``shape`` (None: whole)."""
        split = self.split_of(keys, shape)
        return None if split is None else split.dim

    def spec(self, keys: tuple[str, ...], shape: tuple[int, ...]) -> tuple | None:
        """A rule's layout of the leaf at ``keys`` (None: no rule names it)."""
        split = self.split_of(keys, shape)
        return None if split is None else split.spec

    def lines(self) -> list[str]:
        """Each param's layout, for ``--explain``: the split ones, then the whole ones with why."""
        split = [s for s in self.splits if s.dim is not None]
        lines = [f"Tensor-parallel layout ({self.tensor} devices): {len(split)} params split, "
                 f"{len(self.kept) + len(self.splits) - len(split)} whole"]
        lines += [f"  {s.describe()}" for s in self.splits]
        lines += [f"  {'/'.join(k.path)} {list(k.shape)}: whole ({k.why})" for k in self.kept]
        return lines


def key_names(path: Any) -> tuple[str, ...]:
    """A pytree key path as names: dict keys, attribute names and sequence indices as strings."""
    names = []
    for key in path:
        for attribute in ("key", "name", "idx"):
            if hasattr(key, attribute):
                names.append(str(getattr(key, attribute)))
                break
        else:
            names.append(str(key))
    return tuple(names)
