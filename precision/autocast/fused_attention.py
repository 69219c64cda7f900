"""Fused attention under autocast: ``jax.nn.dot_product_attention`` called again
in the compute dtype, so a GPU runs cuDNN's flash attention.

Autocast traces a model in float32, where ``jax.nn.dot_product_attention`` can
only expand into XLA's attention (two matmuls around a float32 softmax): that
program casts well op by op, but it materialises the ``(batch, heads, T, T)``
logits, while cuDNN's fused kernel, which needs half-precision operands, never
does. So while autocast traces a function, each call of
``jax.nn.dot_product_attention`` is traced as a marked ``jit`` whose name
records the call. Where the call may be cuDNN's (half compute, the model left
``implementation`` open or asked for cuDNN, and cuDNN's attention can be built
here for these shapes), the interpreter makes the call again with query, key
and value in the region's compute dtype, for the platform the program is
*lowered* for: ``jax.lax.platform_dependent`` holds cuDNN's call for CUDA and
the traced (XLA) attention rewritten op by op for every other platform, and
lowering keeps one of the two (three where libtpu is installed: the TPU's
Pallas flash attention too, :mod:`.tpu_attention`). So the choice follows the
target, not the host:
compiling for an H100 from a CPU machine (JAX's compile-only CUDA client),
exporting, and running on the GPU all get cuDNN's kernel, and a CPU run gets
XLA's. Building cuDNN's call needs JAX's CUDA plugin (it describes cuDNN; no
GPU is needed); without it, or where cuDNN cannot take the shapes, only the
op-by-op rewrite is made.

The float32 softmax guarantee holds either way: cuDNN keeps its softmax
statistics in float32, and the op-by-op rewrite keeps ``exp`` and its sums in
float32 (the deny list). A float32 region (a rule) is never sent to cuDNN.

Only calls traced through the ``jax.nn`` module attribute while autocast
traces are seen. A name imported before (``from jax.nn import
dot_product_attention``), or a ``jax.jit``-decorated helper whose trace JAX
cached outside autocast, runs XLA's attention, cast op by op as any other code
(correct, not fused). Conversely a marked trace JAX reuses outside autocast is
the same attention (the mark is a name).
"""

from __future__ import annotations

import ast
import contextlib
import inspect
import threading
from typing import Any, Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["MARK", "QKV", "argument_names", "call_static", "cudnn_call", "cudnn_function", "forward_only", "is_marked",
           "marking", "wants_cudnn", "wants_fused", "where_fused", "fused_kernels"]

#: The arguments autocast casts to the compute dtype; the rest (bias, mask, lengths) stay as traced.
QKV = ("query", "key", "value")

#: Name prefix of the marked ``jit`` a traced attention call becomes.
MARK = "precision_fused_attention_"

_ORIGINAL = jax.nn.dot_product_attention
_SIGNATURE = inspect.signature(_ORIGINAL)
_HALF = (np.dtype(np.float16), np.dtype(jnp.bfloat16))
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
    traced = dict(static)
    if static.get("implementation") == "cudnn" and np.dtype(arrays["query"].dtype) not in _HALF:
        traced["implementation"] = None  # cuDNN takes no float32: XLA's stands in the float32 trace

    def attention(*values):
        return _ORIGINAL(**dict(zip(arrays, values)), **traced)

    try:
        outs = jax.eval_shape(attention, *[jax.ShapeDtypeStruct(np.shape(v), v.dtype) for v in arrays.values()])
        call = (tuple(arrays), _avals(arrays.values()), _avals(jax.tree_util.tree_leaves(outs)), static)
        name = MARK + repr(call).encode().hex()
        described = _decode(name) == call
    except (TypeError, ValueError, SyntaxError):
        described = False
    if not described:  # a static argument that does not survive repr: the call stays unmarked
        return _ORIGINAL(*args, **kwargs)
    # The call is described in the name itself: a traced program that JAX caches
    # and reuses in a later trace stays self-describing.
    attention.__name__ = name
    return jax.jit(attention)(*arrays.values())


def _avals(values: Any) -> tuple:
    return tuple((tuple(np.shape(v)), str(np.dtype(v.dtype))) for v in values)


def _decode(name: str) -> Any:
    return ast.literal_eval(bytes.fromhex(name[len(MARK):]).decode())


@contextlib.contextmanager
def marking() -> Iterator[None]:
    """While tracing in this thread, ``jax.nn.dot_product_attention`` calls become marked."""
    global _installed, _replaced
    with _lock:
        if _installed == 0:
            _replaced = jax.nn.dot_product_attention
            jax.nn.dot_product_attention = _marked_attention
        _installed += 1
    try:
        with _thread_flag("active"):
            yield
    finally:
        with _lock:
            _installed -= 1
            if _installed == 0:
                jax.nn.dot_product_attention = _replaced


@contextlib.contextmanager
def forward_only() -> Iterator[None]:
    """While tracing in this thread, the programs autocast makes are never differentiated
    (serving a model: its prompt's pass and each decode step), so a fused attention is
    chosen by its forward pass alone. cuDNN's attention computes a decode step's one query
    against a long cache, and has no backward pass for it: where a program may be
    differentiated, that attention stays XLA's."""
    with _thread_flag("forward_only"):
        yield


@contextlib.contextmanager
def _thread_flag(name: str) -> Iterator[None]:
    """``name`` set on this thread's state while the block runs, then what it was."""
    previous = getattr(_local, name, False)
    setattr(_local, name, True)
    try:
        yield
    finally:
        setattr(_local, name, previous)


def is_marked(eqn: Any) -> bool:
    """Whether ``eqn`` is a whole marked attention call: its operands and results
    are the call's. (A transformation inside the traced function, such as
    ``jax.grad``, splits a ``jit`` into parts that keep its name but take or
    return other values; those are rewritten as any other program.)"""
    if not str(eqn.params.get("name", "")).startswith(MARK):
        return False
    _, ins, outs, _ = _call(eqn)
    return (_avals(v.aval for v in eqn.invars) == ins
            and _avals(v.aval for v in eqn.outvars) == outs)


def _call(eqn: Any) -> tuple[tuple[str, ...], tuple, tuple, dict]:
    return _decode(str(eqn.params["name"]))


def argument_names(eqn: Any) -> tuple[str, ...]:
    """The names of a marked call's array arguments, in the order of ``eqn``'s operands."""
    return _call(eqn)[0]


def call_static(eqn: Any) -> dict:
    """A marked call's static arguments (scale, causality, implementation...)."""
    return dict(_call(eqn)[3])


def wants_fused(eqn: Any, dtype: Any) -> bool:
    """Whether the marked call ``eqn`` may run as a fused kernel (cuDNN's for CUDA, the TPU's
    Pallas flash attention) with query, key and value in ``dtype``: half operands, and the
    model left ``implementation`` open or asked for cuDNN."""
    return wants_cudnn(eqn, dtype) or (_call(eqn)[3].get("implementation") is None and np.dtype(dtype) in _HALF)


def wants_cudnn(eqn: Any, dtype: Any) -> bool:
    """Whether the marked call ``eqn`` may run as cuDNN's fused attention with
    query, key and value in ``dtype``: half operands, and the model asked for
    cuDNN or left the choice open. Whether cuDNN can take it is
    :func:`cudnn_call`'s to say; where it runs is the lowering's (see above)."""
    implementation = _call(eqn)[3].get("implementation")
    return implementation in (None, "cudnn") and np.dtype(dtype) in _HALF and _cudnn_capable()


def _cudnn_capable() -> bool:
    """False only where this host's own GPUs are too old for cuDNN's fused attention
    (compute capability below 8.0): a program traced there runs there. A CPU host
    may be compiling for a GPU it does not have."""
    if jax.default_backend() != "gpu":
        return True
    return float(getattr(jax.devices()[0], "compute_capability", "0") or 0) >= 8.0


def cudnn_call(eqn: Any, arrays: list) -> Callable[..., list] | None:
    """The marked call ``eqn`` as cuDNN's fused attention: a function of ``arrays``
    (query, key, value and any bias already in the compute dtype, in the call's
    order) returning its output arrays; ``None`` where cuDNN's attention cannot be
    built for them (no CUDA plugin, shapes, head size, or a backward pass it
    cannot run), checked abstractly here."""
    names, _, _, static = _call(eqn)
    return cudnn_function(names, static, arrays)


def cudnn_function(names: tuple[str, ...], static: dict, arrays: list) -> Callable[..., list] | None:
    """``jax.nn.dot_product_attention(**dict(zip(names, arrays)), **static)`` as cuDNN's
    fused attention, a function of the arrays returning its outputs as a list; ``None``
    where cuDNN cannot take them (checked abstractly, the backward pass included but
    under :func:`forward_only`)."""
    static = {**static, "implementation": "cudnn"}

    def attend(*values):
        out = _ORIGINAL(**dict(zip(names, values, strict=True)), **static)
        return list(out) if isinstance(out, tuple) else [out]

    try:
        # cuDNN checks some cases only when the backward pass is built, which may happen
        # later, outside this call (under jax.checkpoint): build it now, abstractly.
        specs = [jax.ShapeDtypeStruct(np.shape(v), v.dtype) for v in arrays]
        forward = getattr(_local, "forward_only", False)
        jax.eval_shape(attend if forward else (lambda *xs: _pull_back(attend, xs)), *specs)
    except (NotImplementedError, RuntimeError, ValueError, TypeError):
        return None
    return attend


def fused_kernels(names: tuple[str, ...], static: dict, arrays: list, cudnn: bool = True,
                  module: tuple[str, ...] = ()) -> tuple[dict, str]:
    """The fused kernels that can compute ``jax.nn.dot_product_attention(**dict(zip(names,
    arrays)), **static)``, by platform (``cuda``: cuDNN's, unless ``cudnn`` is False; ``tpu``:
    the Pallas flash attention, where libtpu is installed), and why the TPU's cannot ("" if it
    can or is not considered). ``module``: the path of the module the call is in, which the
    TPU kernel's passes are named in (see :func:`precision.autocast.tpu_flash.flash`)."""
    from precision.autocast import tpu_attention

    kernels = {"cuda": cudnn_function(names, static, arrays) if cudnn else None}
    tpu_why = ""
    if tpu_attention.available():
        kernels["tpu"], tpu_why = tpu_attention.flash_function(names, static, arrays, module)
    return {p: k for p, k in kernels.items() if k is not None}, tpu_why


def where_fused(kernels: Any) -> str:
    """Where a fused attention runs, for ``explain``: ``kernels`` holds the platforms with a
    fused kernel (``cuda``: cuDNN's, ``tpu``: the Pallas flash attention)."""
    where = {"cuda": "cuDNN where lowered for CUDA", "tpu": "Pallas flash attention where lowered for TPU"}
    return ", ".join([where[p] for p in where if p in kernels] + ["XLA's elsewhere"])


def _pull_back(fn: Any, args: tuple) -> Any:
    out, pull = jax.vjp(fn, *args)
    return pull(jax.tree_util.tree_map(jnp.ones_like, out))
