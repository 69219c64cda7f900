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
from collections import Counter
from typing import Any, Callable

import numpy as np
from jax.extend.core import Literal

from precision.autocast.scaled.int8_activation import activation_prologues
from precision.autocast.scaled.int8_conv import conv_int8_problem, int8_conv
from precision.autocast.scaled.int8_matmul import Backward, int8_dot
from precision.autocast.scaled.int8_quantize import INT8, RECORDING
from precision.autocast.scaled.products import attention_or_size, gradient_dtypes
from precision.autocast.values import Kind
from precision.int8 import Int8Options

__all__ = ["Int8Run", "INT8_MATMUL", "INT8_CONV", "BELOW_MIN_SIZE", "ATTENTION", "NOT_INT8_REGION", "INT8",
           "heads_inputs", "bias_epilogues", "plan", "hinted", "skip_reason", "int8_op", "conv_sizes"]

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


def heads_inputs(jaxpr: Any) -> dict[int, Any]:
    """``{index: var}``: each matmul of ``jaxpr`` whose input is ``var`` reshaped, its last two axes
    ``(heads, head size)`` merged (``out.reshape(batch, length, features)`` of an attention's output,
    then a ``Dense``): an int8 product reads ``var`` instead, contracting both axes, the same values,
    so that on a TPU its kernel reads the attention's output heads-first (:mod:`.int8_tpu`)."""
    made = {v: e for e in jaxpr.eqns for v in e.outvars}
    found = {}
    for i, eqn in enumerate(jaxpr.eqns):
        reshape = made.get(eqn.invars[0]) if eqn.primitive.name == "dot_general" else None
        if reshape is None or reshape.primitive.name != "reshape" or reshape.params.get("dimensions"):
            continue
        (x_contract, w_contract), batch = eqn.params["dimension_numbers"]
        before, after = reshape.invars[0].aval.shape, reshape.outvars[0].aval.shape
        if (len(before) == 4 and len(after) == 3 and tuple(before[:2]) == tuple(after[:2])
                and tuple(x_contract) == (2,) and tuple(w_contract) == (0,) and not any(batch)
                and eqn.invars[1].aval.ndim == 2 and _attention_like(made.get(reshape.invars[0]))):
            found[i] = reshape.invars[0]
    return found


def bias_epilogues(jaxpr: Any, taken: set[int]) -> dict[int, int]:
    """``{add index: matmul index}``: each projection (``x . w``, ``x``'s last axis contracted with the
    weight's first: a ``Dense``, or a ``DenseGeneral`` to ``(heads, head size)``) whose result is read
    once, by the add of its bias (``(1, ..., 1, *the weight's free axes)``): an int8 product adds it in
    its kernel, and its kernel for the weight's gradient sums the bias's from the blocks it reads
    (a TPU's; a product to heads is written heads-first, where the add after it would be a pass of its
    own over that layout). None of ``taken`` (other fusions' equations)."""
    uses = Counter(v for e in jaxpr.eqns for v in e.invars if not isinstance(v, Literal))
    uses.update(v for v in jaxpr.outvars if not isinstance(v, Literal))
    reader = {v: j for j, e in enumerate(jaxpr.eqns) for v in e.invars if not isinstance(v, Literal)}
    found = {}
    for i, eqn in enumerate(jaxpr.eqns):
        out = eqn.outvars[0]
        j = reader.get(out) if eqn.primitive.name == "dot_general" and uses[out] == 1 else None
        if j is None or i in taken or j in taken or jaxpr.eqns[j].primitive.name != "add":
            continue
        a, b = jaxpr.eqns[j].invars
        bias = b if a is out else a
        (x_contract, w_contract), batch = eqn.params["dimension_numbers"]
        x, free = eqn.invars[0].aval, eqn.invars[1].aval.ndim - 1  # the weight's free axes, last in the result
        if (not isinstance(bias, Literal) and free in (1, 2) and x.ndim >= 2 and tuple(x_contract) == (x.ndim - 1,)
                and tuple(w_contract) == (0,) and not any(batch)
                and tuple(bias.aval.shape) == (1,) * (out.aval.ndim - free) + tuple(out.aval.shape[-free:])):
            found[j] = i
    return found


def plan(jaxpr: Any, taken: set[int], top: bool) -> tuple[dict[int, dict], dict[int, int]]:
    """What an int8 policy's products of ``jaxpr`` do beyond their equations: ``({matmul index: hints},
    {add index: matmul index})``, the hints (fields of its :class:`~precision.autocast.context.Site`)
    ``heads_input`` (:func:`heads_inputs`), ``activation`` (:func:`.int8_activation.activation_prologues`)
    and ``f32_result`` (its result, or its bias's sum, is an output of the model's program (``top``) in
    float32: the product writes it so, where a 16-bit result would take a pass to widen it), and the adds
    of a bias the product makes (:func:`bias_epilogues`; none of ``taken``)."""
    hints: dict[int, dict] = {}
    for name, found in (("heads_input", heads_inputs(jaxpr)), ("activation", activation_prologues(jaxpr))):
        for i, value in found.items():
            hints.setdefault(i, {})[name] = value
    biased = bias_epilogues(jaxpr, taken)
    if top:
        wide = {v for v in jaxpr.outvars if not isinstance(v, Literal) and v.aval.dtype == np.dtype(np.float32)}
        dots = {**{i: i for i, e in enumerate(jaxpr.eqns) if e.primitive.name == "dot_general"}, **biased}
        for i, dot in dots.items():
            if jaxpr.eqns[i].outvars[0] in wide:
                hints.setdefault(dot, {})["f32_result"] = True
    return hints, biased


def hinted(site: Any, hints: dict, bias: list | None, read: Callable[[Any], Any]) -> Any:
    """``site`` with its int8 product's ``hints`` (:func:`plan`) as Vals (``read``: a var's) and ``bias`` (a
    holder, :func:`int8_op`); an activation only where its input is held in half (else the product reads
    the activation's result, as written)."""
    heads_input, activation = hints.get("heads_input"), hints.get("activation")
    root = None if activation is None else read(activation.root)
    return dataclasses.replace(site, heads_input=None if heads_input is None else read(heads_input), bias=bias,
                               activation=(activation, root) if root is not None and root.kind is Kind.HALF else None,
                               f32_result=hints.get("f32_result", False))


#: What makes an attention's output as models write it: a call (a remat block, a jitted or custom-derivative
#: attention function), the transpose after the product of probabilities and values, or that product itself.
_CALLS = ("pjit", "closed_call", "remat2", "checkpoint", "custom_vjp_call", "custom_vjp_call_jaxpr", "custom_jvp_call")


def _attention_like(eqn: Any) -> bool:
    """Whether ``eqn`` may have made an attention's ``(batch, length, heads, head size)`` output (not a
    reshape or an elementwise op: another model's features, whose layout heads-first reads would move)."""
    if eqn is None:
        return False
    name = eqn.primitive.name
    return (name in _CALLS or (name == "transpose" and tuple(eqn.params["permutation"]) == (0, 2, 1, 3))
            or (name == "dot_general" and any(eqn.params["dimension_numbers"][1])))


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
    A matmul's ``site.bias`` (a fused projection's part on a TPU, :func:`bias_epilogues`) is added
    by the product itself; its ``site.heads_input`` (:func:`heads_inputs`) is read in place of its
    reshaped input, its ``site.activation``'s input in place of the activation's result
    (:mod:`.int8_activation`), a norm's input in place of the norm's result (:mod:`.int8_norm`: a
    layer or RMS norm's result read by the product, as ``Val.normalized`` says).
    """
    lhs, rhs = (_operand(v, target) for v in ins)
    grads = gradient_dtypes(ins, (lhs, rhs), reduce_dtype, param_target=target)
    options = run.options
    backward = Backward(options.int8_backward, options.stochastic_rounding, np.dtype(target),
                        run.next_salt() if options.stochastic_rounding else 0,
                        "/".join(site.path) if RECORDING.get() is not None else "", options.tpu_kernels,
                        narrow_gradient=site.f32_result)
    if site.name == "conv_general_dilated":
        return int8_conv(lhs, rhs, site.eqn.params, out_dtype, backward, grads), INT8_CONV
    bias = site.bias.pop().array if site.bias else None  # taken: the caller adds it no more
    dims, activation, params = site.eqn.params["dimension_numbers"], None, ()
    normalized = _normalized(ins[0], dims)
    if site.activation is not None:  # the activation's input, the activation applied by the product
        activation, lhs = site.activation[0], _operand(site.activation[1], target)
    elif site.heads_input is not None:  # the input before its (heads, head size) were merged: the same product
        lhs = _operand(site.heads_input, target)
        rhs, dims = rhs.reshape(*lhs.shape[2:], rhs.shape[1]), (((2, 3), (0, 1)), ((), ()))
    elif normalized is not None:  # the norm's input, normalized by the product (its params' gradients too)
        activation, lhs = normalized.norm, _operand(normalized.x, target)
        params = tuple(p.array for p in normalized.params)
    return int8_dot(lhs, rhs, dims, out_dtype, backward, grads, bias, activation, params), INT8_MATMUL


def _normalized(lhs: Any, dims: Any) -> Any:
    """``lhs``'s :class:`.int8_norm.Normalized` where the product may apply its norm itself: its last axis,
    the one normalized, the only one it contracts (no batch axes); else None."""
    normalized = lhs.normalized
    (lhs_contract, _), (lhs_batch, _) = dims
    if normalized is None or lhs_batch or tuple(lhs_contract) != (lhs.array.ndim - 1,):
        return None
    return normalized

