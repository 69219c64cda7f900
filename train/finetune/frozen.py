"""Frozen params: trained by nothing, so they cost nothing but their storage.

A frozen param is read by the model like any other, but it gets no gradient (the
train step differentiates with respect to the trainable params only, so the
weight-gradient products of frozen layers are never computed, not computed and
zeroed), no float32 master and no optimizer state (the optimizer is built over
the trainable params only), and it is stored in the dtype the fine-tuning asks
for (bfloat16 for a base that is only read in the compute dtype anyway).

The train state keeps every param in ``state.params``, so the model, checkpoints,
sharding, ``--explain`` and the doctor see one tree as before; which of them are
frozen is a static set of paths (``TrainState.frozen``), and :func:`trainable`
gives the tree the optimizer sees: the same structure with ``None`` where a
param is frozen (optax and JAX treat ``None`` as an empty subtree).
"""

from __future__ import annotations

import re
from typing import Any, Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["param_path", "param_paths", "frozen_paths", "trainable", "merge", "stored_frozen", "FreezeError"]


class FreezeError(ValueError):
    """A fine-tuning setting that cannot apply to this model (one line: what, where, what is valid)."""


def param_path(path: Sequence[Any]) -> str:
    """``block_0/attn/qkv/kernel``: a param's path in its tree, as rules and configs write it."""
    return jax.tree_util.keystr(tuple(path), simple=True, separator="/")


def param_paths(params: Any) -> list[str]:
    """The paths of every leaf of ``params``, in ``tree_leaves`` order."""
    return [param_path(p) for p, _ in jax.tree_util.tree_leaves_with_path(params)]


def frozen_paths(params: Any, freeze: Iterable[str], keep: Any = None) -> frozenset[str]:
    """The paths of ``params`` matched by a regular expression of ``freeze`` (``re.search``),
    except those ``keep(path)`` says are always trained (LoRA's adapters). A pattern that
    matches no param is an error naming the model's params (a typo would otherwise train
    what was meant to be frozen, silently)."""
    paths = param_paths(params)
    frozen = set()
    for pattern in freeze:
        try:
            compiled = re.compile(pattern)
        except re.error as e:
            raise FreezeError(f"finetune.freeze: {pattern!r} is not a regular expression ({e})") from None
        matched = [p for p in paths if compiled.search(p) and not (keep and keep(p))]
        if not matched:
            modules = dict.fromkeys(p.rsplit("/", 1)[0] for p in paths if "/" in p and not (keep and keep(p)))
            raise FreezeError(f"finetune.freeze: {pattern!r} matches no param of the model (paths such as "
                              f"{paths[0]}); its modules: {_listing(modules)}")
        frozen.update(matched)
    if frozen and len(frozen) == len(paths):
        raise FreezeError("finetune.freeze: every param of the model is frozen: there would be nothing to train")
    return frozenset(frozen)


def _listing(paths: Iterable[str], limit: int = 16) -> str:
    paths = list(paths)
    more = f" ... ({len(paths)} in all)" if len(paths) > limit else ""
    return ", ".join(paths[:limit]) + more


def trainable(params: Any, frozen: frozenset[str]) -> Any:
    """``params`` with ``None`` in place of each frozen param: the tree gradients,
    masters and optimizer state are made over."""
    if not frozen:
        return params
    return jax.tree_util.tree_map_with_path(lambda p, x: None if param_path(p) in frozen else x, params)


def merge(trained: Any, params: Any) -> Any:
    """``params`` with the leaves of ``trained`` (a :func:`trainable` tree) in their place:
    the frozen params unchanged, the trained ones new."""
    return jax.tree_util.tree_map(lambda t, p: p if t is None else t, trained, params,
                                  is_leaf=lambda x: x is None)


def stored_frozen(params: Any, frozen: frozenset[str], dtype: Any) -> Any:
    """``params`` with each floating frozen param cast to ``dtype`` (its storage); the
    trained ones unchanged. ``None``: unchanged."""
    if dtype is None or not frozen:
        return params
    dtype = np.dtype(dtype)

    def store(path, x):
        if param_path(path) in frozen and jnp.issubdtype(x.dtype, jnp.floating):
            return x.astype(dtype)
        return x

    return jax.tree_util.tree_map_with_path(store, params)
