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

from precision.quantized_weights import CODES, is_quantized, quantizable, quantize_weight

__all__ = ["param_path", "param_paths", "param_leaves", "frozen_paths", "trainable", "merge", "stored_frozen",
           "FreezeError"]


class FreezeError(ValueError):
    """A fine-tuning setting that cannot apply to this model (one line: what, where, what is valid)."""


def param_path(path: Sequence[Any]) -> str:
    """``block_0/attn/qkv/kernel``: a param's path in its tree, as rules and configs write it."""
    return jax.tree_util.keystr(tuple(path), simple=True, separator="/")


def param_paths(params: Any) -> list[str]:
    """The paths of every param of ``params``, in ``tree_leaves`` order (a weight stored in
    codes, :class:`precision.QuantizedWeight`, is one param)."""
    return [param_path(p) for p, _ in jax.tree_util.tree_leaves_with_path(params, is_leaf=is_quantized)]


def param_leaves(params: Any) -> dict[str, Any]:
    """``{path: param}``, a weight stored in codes as one param."""
    return {param_path(p): x for p, x in jax.tree_util.tree_leaves_with_path(params, is_leaf=is_quantized)}


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
    return jax.tree_util.tree_map_with_path(lambda p, x: None if param_path(p) in frozen else x, params,
                                            is_leaf=is_quantized)


def merge(trained: Any, params: Any) -> Any:
    """``params`` with the leaves of ``trained`` (a :func:`trainable` tree) in their place:
    the frozen params unchanged, the trained ones new."""
    return jax.tree_util.tree_map(lambda t, p: p if t is None else t, trained, params,
                                  is_leaf=lambda x: x is None or is_quantized(x))


def stored_frozen(params: Any, frozen: frozenset[str], dtype: Any) -> Any:
    """``params`` with each floating frozen param stored as ``dtype`` says: a floating dtype,
    or ``"int8"`` / ``"nf4"`` (:mod:`precision.quantized_weights`: weight matrices in codes,
    the smaller ones in bfloat16); the trained ones unchanged. ``None``: unchanged."""
    if dtype is None or not frozen:
        return params
    code = dtype if isinstance(dtype, str) and dtype in CODES else None
    floating = jnp.bfloat16 if code else np.dtype(dtype)

    def store(path, x):
        if param_path(path) not in frozen or not jnp.issubdtype(x.dtype, jnp.floating):
            return x
        return quantize_weight(x, code) if code and quantizable(x) else x.astype(floating)

    return jax.tree_util.tree_map_with_path(store, params)
