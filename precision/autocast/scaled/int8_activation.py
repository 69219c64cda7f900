"""An elementwise activation before an int8 product, applied by the product's own kernels.

A GELU (ReLU, SiLU, tanh...) between an MLP's two projections costs a bf16 step
nothing of its own on a TPU: XLA fuses it into the matmuls around it, forward and
backward. The int8 products of a one-TPU program are Pallas kernels, which XLA
fuses nothing into, so there the activation was a pass of its own over the
block's widest activation, forward and backward: about 1.3 ms a layer of GPT-2
small's modeled v5e step, where its MLP's six int8 kernels take 1.6. Instead the second product
reads the activation's input ``h`` and applies the activation itself
(:mod:`.int8_tpu`):

- forward: its row kernel computes ``act(h)`` in float32 on each row block in
  VMEM, then quantizes it as it would its input;
- its weight's gradient: the tiled kernel does the same to its token tiles;
- its input's gradient: the row kernel multiplies ``dy . wᵀ`` by ``act'(h)``
  (``jax.vjp`` of the activation on the block, ``h``'s block read beside it)
  before its one rounding: the gradient of ``h`` itself.

The activation is the model's own equations (:class:`Activation`), whatever
function wrote them, evaluated in float32: the values of the same activation
computed in float32 and quantized from there (a bf16 program rounds it to bf16
first). :func:`activation_prologues` finds them: a chain of elementwise
equations from one value to a matmul's input, each read by the chain alone.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from typing import Any

import jax
import numpy as np
from jax.extend.core import Literal

__all__ = ["Activation", "ELEMENTWISE", "activation_prologues"]

#: Elementwise primitives an activation may be made of (each lowers inside a Mosaic kernel).
ELEMENTWISE = frozenset({"add", "sub", "mul", "div", "neg", "max", "min", "abs", "square", "integer_pow", "sqrt",
                         "rsqrt", "exp", "logistic", "tanh"})
_TRANSCENDENTAL = frozenset({"sqrt", "rsqrt", "exp", "logistic", "tanh", "div"})
_CALLS = ("pjit", "jit")  # a jitted function's equation (its name across jax versions)


@dataclasses.dataclass(frozen=True, eq=False)
class Activation:
    """The equations ``eqns`` (program order) that make ``out`` from ``root`` alone, elementwise: called on
    an array of any shape (a kernel's block) in float32, they make its activation in float32. Hashed by
    identity: a static argument of the int8 product's derivative."""

    root: Any
    eqns: tuple
    out: Any
    row_wise = False  # elementwise: any block of its input will do
    params = 0  # it reads nothing but its input (a norm reads its scale and offset: .int8_norm)

    def __call__(self, x: jax.Array) -> jax.Array:
        return _apply(self.eqns, {self.root: x})[self.out]

    def backward(self, x: jax.Array, d_out: jax.Array) -> tuple[jax.Array]:
        """``(d_out`` times the activation's derivative at ``x``,) (both float32): the gradient of ``x``."""
        return jax.vjp(self, x)[1](d_out)

    @property
    def transcendentals(self) -> int:
        """Transcendental operations per element (a kernel's cost estimate)."""
        return sum(name in _TRANSCENDENTAL for name in _names(self.eqns))


def _apply(eqns: Any, env: dict) -> dict:
    """``env`` with the values ``eqns`` make from it, a jitted function's by its own equations (shapes free)."""
    for eqn in eqns:
        ins = [v.val if isinstance(v, Literal) else env[v] for v in eqn.invars]
        if eqn.primitive.name in _CALLS:
            body = eqn.params["jaxpr"].jaxpr
            out = _apply(body.eqns, dict(zip(body.invars, ins)))[body.outvars[0]]
        else:
            out = eqn.primitive.bind(*ins, **eqn.params)
        env[eqn.outvars[0]] = out
    return env


def _names(eqns: Any) -> list[str]:
    """The primitives of ``eqns``, a jitted function's by its equations."""
    return [n for e in eqns for n in (_names(e.params["jaxpr"].jaxpr.eqns) if e.primitive.name in _CALLS
                                      else [e.primitive.name])]


def activation_prologues(jaxpr: Any) -> dict[int, Activation]:
    """``{matmul index: its input's Activation}``: each ``dot_general`` whose first operand is made by a
    chain of :data:`ELEMENTWISE` float32 equations from one value of its shape (scalar literals aside),
    every value of the chain read by the chain alone and its result by the matmul alone: its int8
    product may read the chain's root and apply the chain itself (the chain's equations still run, as
    written, and XLA drops them where nothing else reads them)."""
    made = {v: (i, e) for i, e in enumerate(jaxpr.eqns) for v in e.outvars}
    readers: dict[Any, set] = defaultdict(set)
    for i, eqn in enumerate(jaxpr.eqns):
        for v in eqn.invars:
            if not isinstance(v, Literal):
                readers[v].add(i)
    for v in jaxpr.outvars:
        if not isinstance(v, Literal):
            readers[v].add(-1)
    found = {}
    for i, eqn in enumerate(jaxpr.eqns):
        if eqn.primitive.name == "dot_general" and not isinstance(eqn.invars[0], Literal):
            chain = _chain(eqn.invars[0], made, readers, i)
            if chain is not None:
                found[i] = chain
    return found


def _chain(out: Any, made: dict, readers: dict, product: int) -> Activation | None:
    """The :class:`Activation` making ``out`` (read by equation ``product`` alone), or None."""
    if readers[out] != {product}:
        return None
    shape, members, roots, stack = out.aval.shape, {}, set(), [out]
    while stack:
        v = stack.pop()
        producer = made.get(v)
        if producer is None or not _elementwise(producer[1], shape):
            roots.add(v)
        elif producer[0] not in members:
            members[producer[0]] = producer[1]
            stack.extend(u for u in producer[1].invars if not isinstance(u, Literal))
    if len(roots) != 1 or not members:
        return None
    inside = set(members)
    if any(readers[e.outvars[0]] - inside for e in members.values() if e.outvars[0] is not out):
        return None
    return Activation(roots.pop(), tuple(members[i] for i in sorted(members)), out)


def _elementwise(eqn: Any, shape: tuple) -> bool:
    """Whether ``eqn`` may be part of an activation of values of ``shape``: an :data:`ELEMENTWISE` float32
    equation of one result, its operands of that shape or scalar literals; or a jitted function of one
    operand made of such equations (``jax.nn.silu``; not a custom derivative's: ``jax.nn.relu``)."""
    if len(eqn.outvars) != 1:
        return False
    if eqn.primitive.name in _CALLS:
        closed = eqn.params["jaxpr"]
        body = closed.jaxpr
        if closed.consts or body.constvars or len(eqn.invars) != 1 or len(body.invars) != 1:
            return False
        made = {body.invars[0]}
        for inner in body.eqns:
            if not _elementwise(inner, shape) or any(v not in made for v in inner.invars if not isinstance(v, Literal)):
                return False
            made.add(inner.outvars[0])
        return body.outvars[0] in made and _elementwise_operands(eqn, shape)
    return eqn.primitive.name in ELEMENTWISE and _elementwise_operands(eqn, shape)


def _elementwise_operands(eqn: Any, shape: tuple) -> bool:
    """Whether ``eqn``'s result and operands are float32 of ``shape``, or scalar float32 literals."""
    float32 = np.dtype(np.float32)
    if eqn.outvars[0].aval.dtype != float32 or tuple(eqn.outvars[0].aval.shape) != tuple(shape):
        return False
    return all((v.aval.shape == () and v.aval.dtype == float32) if isinstance(v, Literal)
               else (tuple(v.aval.shape) == tuple(shape) and v.aval.dtype == float32) for v in eqn.invars)
