"""The precision of float32 matmuls under a policy (``matmul=highest`` in a spec).

On GPUs with tensor cores for it (Ampere, Hopper...), XLA runs a float32
``dot_general`` or convolution at ``jax.lax.Precision.DEFAULT`` as TF32: its
operands rounded to 10 bits of mantissa. A policy or rule that keeps a module in
float32 for accuracy gets that unless the op asks for more. Autocast therefore
sets the ``precision`` of every ``dot_general``, ``conv_general_dilated`` and
``ragged_dot_general`` whose floating operands are float32 as it binds it, from
the policy of the module (or region, :func:`precision.compute_in`) it sits in.

What wins: the policy's precision is the *least* such an op gets. An op that
already asks for more (``precision=HIGHEST`` in the model, or
``jax.default_matmul_precision`` around the trace) keeps it; one that asks for
less (or nothing) is raised to the policy's, operand by operand. An op that
names a dot algorithm (``jax.lax.DotAlgorithmPreset``) fixes its arithmetic
itself and is left alone. Half-precision and FP8 matmuls are never touched, and
under ``default`` nothing is: the program is the one before this existed.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import jax.numpy as jnp
import numpy as np
from jax import lax

__all__ = ["PRECISIONS", "MATMULS", "update", "precision_name"]

#: A policy's matmul precision as ``jax.lax.Precision``.
PRECISIONS: Mapping[str, lax.Precision] = {"default": lax.Precision.DEFAULT, "high": lax.Precision.HIGH,
                                           "highest": lax.Precision.HIGHEST}
#: The primitives whose ``precision`` param a policy sets.
MATMULS = frozenset({"dot_general", "conv_general_dilated", "ragged_dot_general"})
_F32 = np.dtype(np.float32)


def _all_float32(args: Sequence[Any]) -> bool:
    """Whether the floating operands (there is one at least) are all float32."""
    floats = [np.dtype(a.dtype) for a in args if hasattr(a, "dtype") and jnp.issubdtype(a.dtype, jnp.floating)]
    return bool(floats) and all(d == _F32 for d in floats)


def _is_pair(precision: Any) -> bool:
    return isinstance(precision, tuple) and len(precision) == 2 and all(isinstance(p, lax.Precision) for p in precision)


def update(name: str, params: Mapping[str, Any], args: Sequence[Any], wanted: str) -> dict[str, Any]:
    """The param update (``{"precision": (HIGHEST, HIGHEST)}``, or ``{}``) that gives the
    matmul ``name`` bound on ``args`` with ``params`` at least precision ``wanted``."""
    if wanted == "default" or name not in MATMULS or "precision" not in params or not _all_float32(args):
        return {}
    current = params["precision"]
    if current is not None and not _is_pair(current):
        return {}  # a named dot algorithm: its arithmetic is what the model asked for
    least = PRECISIONS[wanted]
    pair = current or (lax.Precision.DEFAULT, lax.Precision.DEFAULT)
    raised = tuple(p if p.value >= least.value else least for p in pair)
    return {} if raised == current else {"precision": raised}


def precision_name(precision: Any) -> str:
    """A matmul's ``precision`` param in words: ``default``, ``highest``, ``high/highest``
    for a mixed pair, or a dot algorithm's name (``F32_F32_F32``)."""
    if precision is None:
        return "default"
    if _is_pair(precision):
        names = [p.name.lower() for p in precision]
        return names[0] if names[0] == names[1] else "/".join(names)
    return str(getattr(precision, "name", precision))
