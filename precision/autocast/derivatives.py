"""Follow ops computed in half whose derivative needs a deny-listed op.

JAX differentiates the rewritten program: each op's derivative computes in the
dtype the op computed in. For most ops that follow their inputs that is right
(``tanh``'s derivative is ``1 - y**2``, half like ``tanh``), but the derivative
of ``erf`` (exact GELU) and ``erfc`` is an exponential, ``2/sqrt(pi) * exp(-x**2)``,
and ``exp`` is deny-listed: it computes in float32, in the backward pass too. So
where one of these ops computes in half, autocast binds it as a ``custom_jvp``
function: the op itself in half, its derivative's exponential in float32, the
tangent returned in the op's dtype. The forward pass and what it saves are
unchanged; only the derivative is computed in float32.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax import lax

__all__ = ["HALF_WITH_FLOAT32_DERIVATIVE"]


def _with_float32_derivative(op: Callable[[Any], Any], derivative: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """``op`` with ``derivative`` (of the float32 input) as its JVP, in float32."""

    @jax.custom_jvp
    def half_op(x):
        return op(x)

    @half_op.defjvp
    def _jvp(primals, tangents):
        (x,), (t,) = primals, tangents
        slope = derivative(x.astype(jnp.float32))
        return op(x), (t.astype(jnp.float32) * slope).astype(t.dtype)

    return half_op


_TWO_OVER_SQRT_PI = 2.0 / math.sqrt(math.pi)

#: Primitive name -> the op, computed in the input's dtype, with its derivative in float32.
HALF_WITH_FLOAT32_DERIVATIVE: dict[str, Callable[[Any], Any]] = {
    "erf": _with_float32_derivative(lax.erf, lambda x: _TWO_OVER_SQRT_PI * jnp.exp(-x * x)),
    "erfc": _with_float32_derivative(lax.erfc, lambda x: -_TWO_OVER_SQRT_PI * jnp.exp(-x * x)),
}
