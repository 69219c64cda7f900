"""Where autocast puts a matmul or convolution in int8.

An allow-listed ``dot_general`` or ``conv_general_dilated`` in an int8 region
(the policy's compute is ``int8``, or a rule or :func:`precision.compute_in`
says so) becomes :func:`~.int8_matmul.int8_dot` or :func:`~.int8_conv.int8_conv`
when each of its M, K, N is at least ``min_size`` (a convolution: output
pixels, window x input channels, output channels) and, unless ``attention`` is
asked, it is not a batched product of two activations. Int8 scales are current:
there is no state, so a matmul in a loop body, a remat block or a custom rule
is int8 like any other. Every decision is logged for :func:`precision.explain`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from precision.autocast.scaled.int8_conv import conv_int8_problem, int8_conv
from precision.autocast.scaled.int8_matmul import Backward, int8_dot
from precision.autocast.scaled.int8_quantize import INT8, RECORDING
from precision.autocast.scaled.products import attention_or_size, gradient_dtypes
from precision.autocast.values import Kind
from precision.int8 import Int8Options

__all__ = ["Int8Run", "INT8_MATMUL", "INT8_CONV", "BELOW_MIN_SIZE", "ATTENTION", "NOT_INT8_REGION", "INT8",
           "skip_reason", "int8_op", "conv_sizes"]

# Reasons logged (the Record's dtype is int8 for an int8 matmul, the fallback otherwise).
INT8_MATMUL = "int8 matmul (row and column scales)"
INT8_CONV = "int8 matmul (convolution: per-example and per-channel scales)"
BELOW_MIN_SIZE = "below int8 min_size"
ATTENTION = "attention stays out of int8"
NOT_INT8_REGION = "a rule keeps it out of int8"
_OPS = ("dot_general", "conv_general_dilated")


@dataclasses.dataclass
class Int8Run:
    """One autocast call's int8 settings: the options, and how many int8 products it has made
    (each one's stochastic rounding draws from its own salt)."""

    options: Int8Options = dataclasses.field(default_factory=Int8Options)
    made: list = dataclasses.field(default_factory=lambda: [0])

    def next_salt(self) -> int:
        self.made[0] += 1
        return self.made[0]


def conv_sizes(eqn: Any) -> tuple[int, int, int]:
    """(M, K, N) of a convolution: output pixels (examples included), window x input channels, output channels."""
    spec = eqn.params["dimension_numbers"]
    rhs, out = eqn.invars[1].aval.shape, eqn.outvars[0].aval.shape
    n = rhs[spec.rhs_spec[0]]
    return math.prod(out) // max(n, 1), math.prod(rhs) // max(n, 1), n


def skip_reason(primitive: str, ins: list, eqn: Any, options: Int8Options) -> str | None:
    """Why an allow-listed op in an int8 region stays in the fallback dtype (None: it is int8)."""
    if primitive not in _OPS:
        return "int8 takes dot_general and conv_general_dilated only"
    if not all(v.managed for v in ins):
        return "an operand the policy does not manage (already 8-bit, or integer)"
    if primitive == "conv_general_dilated":
        problem = conv_int8_problem(eqn.params)
        if problem:
            return problem
        return attention_or_size(eqn, ins, options.attention, options.min_size, "int8", conv_sizes(eqn))
    return attention_or_size(eqn, ins, options.attention, options.min_size, "int8")


def _operand(v: Any, target: np.dtype) -> Any:
    """An operand as the int8 product reads it (see :func:`int8_op`)."""
    if v.kind is Kind.NEUTRAL or (not v.leaf and np.dtype(v.dtype).itemsize > np.dtype(target).itemsize):
        return v.as_dtype(target)
    return v.array


def int8_op(site: Any, ins: list, run: Int8Run, target: np.dtype, out_dtype: np.dtype,
            reduce_dtype: np.dtype | None = None) -> tuple[Any, str]:
    """The site's matmul or convolution in int8: (result in ``out_dtype``, the reason to log).

    A param (a float32 master weight) is quantized straight from the dtype it is
    held in; an activation held wider than ``target`` (the fallback: a float32
    island's result) and a constant take ``target`` first, so the backward saves
    activations in 16 bits, as the fallback's matmul would. The backward's
    products run in int8 or in ``target``, as the options say; a param's
    gradient is made in ``reduce_dtype`` when given, else in ``target``, as
    the fallback's matmul makes it (on the cast param), then reaches the master
    in its own dtype: never written and read back in float32 at twice the bytes.
    """
    lhs, rhs = (_operand(v, target) for v in ins)
    grads = gradient_dtypes(ins, (lhs, rhs), reduce_dtype, param_target=target)
    options = run.options
    backward = Backward(options.int8_backward, options.stochastic_rounding, np.dtype(target),
                        run.next_salt() if options.stochastic_rounding else 0,
                        "/".join(site.path) if RECORDING.get() is not None else "", options.tpu_kernels)
    if site.name == "conv_general_dilated":
        return int8_conv(lhs, rhs, site.eqn.params, out_dtype, backward, grads), INT8_CONV
    return int8_dot(lhs, rhs, site.eqn.params["dimension_numbers"], out_dtype, backward, grads), INT8_MATMUL

