"""What training stores, in bytes per parameter, by part (docs/stored-state.md)."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from precision.optim import find_mixed_precision_state
from precision.quantized_weights import is_quantized, logical_size

__all__ = ["state_bytes"]


def _nbytes(tree: Any) -> int:
    return sum(int(np.prod(np.shape(x), dtype=np.int64)) * np.dtype(x.dtype).itemsize
               for x in jax.tree_util.tree_leaves(tree) if hasattr(x, "dtype"))


def state_bytes(params: Any, opt_state: Any, accumulation: Any = None) -> dict[str, float]:
    """Bytes per parameter of what training stores, by part: ``params``, ``masters``
    (float32 copies, or bfloat16 masters' compensation), ``optimizer`` (the inner
    optimizer's state), ``other`` (loss scale, counters) and ``total``. Exact from the
    leaves' shapes and dtypes: works on ``jax.eval_shape`` results (nothing allocated).

    ``accumulation``: the dtype micro-batch gradients are summed in (a policy's
    ``accum_dtype``, float32 when None), when a step accumulates: adds an
    ``accumulation`` part, a buffer the size of the params that lives during the step
    and is counted in ``total``."""
    count = sum(logical_size(x) for x in jax.tree_util.tree_leaves(params, is_leaf=is_quantized)) or 1
    mp = find_mixed_precision_state(opt_state)
    parts = {"params": _nbytes(params), "masters": _nbytes((mp.master_params, mp.stored_masters)),
             "optimizer": _nbytes(mp.inner_state)}
    parts["other"] = _nbytes(opt_state) - parts["masters"] - parts["optimizer"]
    if accumulation is not None:
        parts["accumulation"] = np.dtype(accumulation).itemsize * count
    parts["total"] = sum(parts.values())
    return {k: v / count for k, v in parts.items()}
