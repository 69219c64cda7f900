"""Fused attention under autocast: ``jax.nn.dot_product_attention`` called again
in the compute dtype, so a GPU runs cuDNN's flash attention.

Autocast traces a model in float32, where ``jax.nn.dot_product_attention`` can
only expand into XLA's attention (two matmuls around a float32 softmax): that
program casts well op by op, but it materialises the ``(batch, heads, T, T)``
logits, while cuDNN's fused kernel, which needs half-precision operands, never
does. So while autocast traces a function, each call of
``jax.nn.dot_product_attention`` is traced as a marked ``jit`` whose name
records the call. Where the call should be cuDNN's (on a GPU, half compute, the
model left ``implementation`` open or asked for cuDNN), the interpreter does
not rewrite that program but makes the call again with query, key and value in
the region's compute dtype (everything else as traced). Elsewhere, or where
cuDNN cannot take the shapes, it rewrites the traced XLA attention op by op as
any other program: half matmuls around a float32 softmax.

The float32 softmax guarantee holds either way: cuDNN keeps its softmax
statistics in float32, and the op-by-op rewrite keeps ``exp`` and its sums in
float32 (the deny list). A float32 region (a rule) is never sent to cuDNN.

Only calls made through the ``jax.nn`` module attribute are seen; a name
imported before (``from jax.nn import dot_product_attention``) runs XLA's
attention, cast op by op as any other code.
"""

from __future__ import annotations

import ast
import contextlib
import inspect
import threading
from typing import Any, Iterator

import jax
import numpy as np

__all__ = ["MARK", "QKV", "argument_names", "call_cudnn", "is_marked", "marking", "wants_cudnn"]

#: The arguments autocast casts to the compute dtype; the rest (bias, mask, lengths) stay as traced.
QKV = ("query", "key", "value")

#: Name prefix of the marked ``jit`` a traced attention call becomes.
MARK = "precision_fused_attention_"

_ORIGINAL = jax.nn.dot_product_attention
_SIGNATURE = inspect.signature(_ORIGINAL)
_HALF = (np.dtype(np.float16), np.dtype(jax.numpy.bfloat16))
_local = threading.local()
_lock = threading.Lock()
_installed = 0
_replaced = _ORIGINAL  # what jax.nn held when marking began


def _marked_attention(*args: Any, **kwargs: Any) -> Any:
    """``jax.nn.dot_product_attention``, traced as a marked ``jit`` inside :func:`marking`."""
    if not getattr(_local, "active", False):
        return _ORIGINAL(*args, **kwargs)
    bound = _SIGNATURE.bind(*args, **kwargs)
    arrays = {k: v for k, v in bound.arguments.items() if isinstance(v, (jax.Array, np.ndarray))}
    static = {k: v for k, v in bound.arguments.items() if k not in arrays}
    if not all(k in arrays for k in QKV):  # query, key or value given as a list: left as it is
        return _ORIGINAL(*args, **kwargs)
    try:
        avals = tuple((tuple(np.shape(v)), str(np.dtype(v.dtype))) for v in arrays.values())
        call = (tuple(arrays), avals, static)
        name = MARK + repr(call).encode().hex()
        described = ast.literal_eval(bytes.fromhex(name[len(MARK):]).decode()) == call
    except (TypeError, ValueError, SyntaxError):
        described = False
    if not described:  # a static argument that does not survive repr: the call stays unmarked
        return _ORIGINAL(*args, **kwargs)

    traced = dict(static)
    if static.get("implementation") == "cudnn" and np.dtype(arrays["query"].dtype) not in _HALF:
        traced["implementation"] = None  # cuDNN takes no float32: XLA's stands in the float32 trace

    def attention(*values):
        return _ORIGINAL(**dict(zip(arrays, values)), **traced)

    # The call is described in the name itself: a traced program that JAX caches
    # and reuses in a later trace stays self-describing.
    attention.__name__ = name
    return jax.jit(attention)(*arrays.values())


@contextlib.contextmanager
def marking() -> Iterator[None]:
    """While tracing in this thread, ``jax.nn.dot_product_attention`` calls become marked."""
    global _installed, _replaced
    with _lock:
        if _installed == 0:
            _replaced = jax.nn.dot_product_attention
            jax.nn.dot_product_attention = _marked_attention
        _installed += 1
    previous = getattr(_local, "active", False)
    _local.active = True
    try:
        yield
    finally:
        _local.active = previous
        with _lock:
            _installed -= 1
            if _installed == 0:
                jax.nn.dot_product_attention = _replaced


def is_marked(eqn: Any) -> bool:
    """Whether ``eqn`` is a whole marked attention call. (A transformation that
    splits a ``jit``, JAX's partial evaluation, keeps its name on the parts; a
    part has other operands and is rewritten as any other program.)"""
    if not str(eqn.params.get("name", "")).startswith(MARK):
        return False
    _, avals, _ = _call(eqn)
    return [(tuple(v.aval.shape), str(np.dtype(v.aval.dtype))) for v in eqn.invars] == list(avals)


def _call(eqn: Any) -> tuple[tuple[str, ...], tuple, dict]:
    return ast.literal_eval(bytes.fromhex(str(eqn.params["name"])[len(MARK):]).decode())


def argument_names(eqn: Any) -> tuple[str, ...]:
    """The names of a marked call's array arguments, in the order of ``eqn``'s operands."""
    return _call(eqn)[0]


def wants_cudnn(eqn: Any, dtype: Any) -> bool:
    """Whether the marked call ``eqn`` should run as cuDNN's fused attention with
    query, key and value in ``dtype``: the model asked for cuDNN, or left the
    choice open and the operands are half on a GPU. Otherwise autocast rewrites
    the traced (XLA) attention op by op, as any other program."""
    implementation = _call(eqn)[2].get("implementation")
    chosen = implementation == "cudnn" or (implementation is None and jax.default_backend() == "gpu")
    return chosen and np.dtype(dtype) in _HALF


def call_cudnn(eqn: Any, arrays: list) -> list | None:
    """The marked call ``eqn`` made again as cuDNN's fused attention on ``arrays``
    (query, key and value already in the compute dtype); its output arrays, or
    ``None`` where cuDNN cannot take it (shapes, head size, cuDNN version)."""
    names, _, static = _call(eqn)
    try:
        out = _ORIGINAL(**dict(zip(names, arrays, strict=True)), **{**static, "implementation": "cudnn"})
    except (NotImplementedError, RuntimeError, ValueError, TypeError):
        return None
    return list(out) if isinstance(out, tuple) else [out]
