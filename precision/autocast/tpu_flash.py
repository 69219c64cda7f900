"""JAX's Pallas attention kernels for TPU, on one chip or each chip of a mesh.

An attention with a bias runs JAX's flash attention kernel; one without, its
splash attention kernel (:mod:`.tpu_splash`: less of HBM for the softmax's
statistics). Both are "the kernel" below.

A Pallas (Mosaic) kernel is one custom call that XLA cannot split over devices:
in a program sharded over a TPU slice it fails to lower unless each device is
given its own part. So :func:`flash` runs the kernel

- under a mesh in context (``jax.sharding.use_abstract_mesh`` or ``jax.set_mesh``,
  as ``train``'s step sets it), inside ``jax.shard_map``: each device on its own
  batch rows (the batch split over every axis of the mesh), all heads and
  positions (the causal mask needs them whole);
- otherwise as it is, where the program is lowered for one device. Whether it is
  is known only when it is lowered: a primitive (:data:`one_device_p`) lowers
  the kernel for one device and XLA's attention (which XLA can split) for more,
  so no program fails to lower for a slice, and the numbers are the same up to
  rounding either way.

The forward and backward passes are the kernel's own: the functions
``flash_attention``'s (or splash's) ``custom_vjp`` is made of (private to JAX: a
JAX without them leaves the attention unfused, and ``explain`` says so).
"""

from __future__ import annotations

import contextlib
import functools
import math
from typing import Any, Callable, Iterator

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import batching, mlir
from jax.sharding import PartitionSpec

from precision.autocast import tpu_splash
from precision.autocast.regions import module_tag

__all__ = ["check", "flash", "one_device_p", "on_one_device", "module_path", "FORWARD_SCOPE", "BACKWARD_SCOPE"]

#: The scopes the kernel's passes are named in (what :mod:`train.inspections.tpu_kernels` reads).
FORWARD_SCOPE = "pallas_flash_attention"
BACKWARD_SCOPE = "pallas_flash_attention_bwd"


def module_path(path: str) -> str:
    """A kernel's module path (``block_0/attn/pallas_flash_attention_bwd/splash_mha_dq...``) as its
    attention's (``block_0/attn``), for either pass."""
    return path.split(f"/{FORWARD_SCOPE}")[0]


_MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)  # the kernel's own fill for masked logits


def flash(q: jax.Array, k: jax.Array, v: jax.Array, ab: jax.Array | None, causal: bool, scale: float,
          heads_second: bool = False, module: tuple[str, ...] = ()) -> jax.Array:
    """``flash_attention(q, k, v, ab, causal=causal, sm_scale=scale)`` over ``(batch, heads,
    length, head size)`` operands (``ab``: ``(batch, heads, T, S)`` float32, or None),
    differentiable; per device under a mesh in context. ``heads_second``: ``q``, ``k``, ``v``
    and the result in ``jax.nn``'s ``(batch, length, heads, head size)`` instead, and so the
    residuals kept for the backward pass: those of the other platforms' attention (cuDNN's,
    XLA's) are the same arrays, so a program holding every platform's branch keeps them once
    (a ``cond``'s branches share residual slots of one shape and dtype). ``module``: the path
    of the module the call is in, named again inside each pass: the compiled program's readers
    find the kernel's module there (JAX 0.11 lowers the forward pass inside ``shard_map``
    without its caller's name stack)."""
    attention = _attention(causal, scale, ab is not None, heads_second, tuple(module))
    args = (q, k, v) if ab is None else (q, k, v, ab)
    batch, heads = _split_axes(q.shape[0], q.shape[1])
    if not batch and not heads:
        return attention(*args)
    spec = PartitionSpec(batch or None, heads or None)
    specs = (spec,) * 3 + (() if ab is None else (spec if ab.shape[1] == q.shape[1] else PartitionSpec(batch or None),))
    return jax.shard_map(attention, mesh=jax.sharding.get_abstract_mesh(), in_specs=specs, out_specs=spec,
                         check_vma=False)(*args)


def check(q: Any, k: Any, v: Any, ab: Any, causal: bool, scale: float) -> None:
    """Builds the kernel's forward and backward passes for these shapes (abstractly, on one
    device's part where a mesh is in context); raises what Pallas raises where it cannot."""
    batch, heads = _split_axes(q.shape[0], q.shape[1])
    mesh = jax.sharding.get_abstract_mesh()
    b, h = (math.prod(mesh.shape[a] for a in axes) if axes else 1 for axes in (batch, heads))
    local = [jax.ShapeDtypeStruct((x.shape[0] // b, x.shape[1] // h, *x.shape[2:]), x.dtype) for x in (q, k, v)]
    args = (*local, jax.ShapeDtypeStruct((q.shape[0] // b, ab.shape[1] // (h if ab.shape[1] == q.shape[1] else 1),
                                          *ab.shape[2:]), ab.dtype)) if ab is not None else local
    out, l, m = jax.eval_shape(functools.partial(_kernel_fwd, causal, scale, ab is not None), *args)
    jax.eval_shape(functools.partial(_kernel_bwd, causal, scale, ab is not None), *args, out, l, m, out)


def _split_axes(batch: int, heads: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The context mesh's axes (those not manual already) to split the batch over, outermost
    first while their product divides it, and the rest to split the heads over (a layout that
    splits each layer over an inner axis splits attention by heads) where they divide them;
    none without a mesh or on one device."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty:
        return (), ()
    manual = set(getattr(mesh, "manual_axes", ()))
    axes = [name for name in mesh.axis_names if name not in manual and mesh.shape[name] > 1]
    split = 0
    while split < len(axes) and batch % math.prod(mesh.shape[a] for a in axes[:split + 1]) == 0:
        split += 1
    rest = tuple(axes[split:])
    if rest and heads % math.prod(mesh.shape[a] for a in rest):
        return (), ()  # a batch and heads the mesh does not divide: the whole call on each device
    return tuple(axes[:split]), rest


def _swap(x: jax.Array) -> jax.Array:
    return jnp.transpose(x, (0, 2, 1, 3))  # (B, T, N, H) <-> (B, N, T, H)


@functools.lru_cache(maxsize=None)
def _attention(causal: bool, scale: float, biased: bool, heads_second: bool = False,
               module: tuple[str, ...] = ()) -> Callable:
    forward = functools.partial(_kernel_fwd, causal, scale, biased)
    backward = functools.partial(_kernel_bwd, causal, scale, biased)
    forward_xla = functools.partial(_xla_fwd, causal, scale, biased)
    backward_xla = functools.partial(_xla_bwd, causal, scale, biased)

    @contextlib.contextmanager
    def named(scope: str) -> Iterator[None]:  # the module's tag (see `flash`), then the pass's scope
        with jax.named_scope(module_tag(module)) if module else contextlib.nullcontext(), jax.named_scope(scope):
            yield

    def run_forward(*args):
        with named(FORWARD_SCOPE):
            return choose(*args, kernel=forward, fallback=forward_xla)

    @jax.custom_vjp
    def attention(*args):
        return run_forward(*args)[0]

    def fwd(*args):
        out, l, m = run_forward(*args)
        return out, (*args, out, l, m)

    def bwd(residuals, do):
        with named(BACKWARD_SCOPE):
            return tuple(choose(*residuals, do, kernel=backward, fallback=backward_xla))

    if heads_second:  # operands, result and residuals in jax.nn's layout; the kernel in its own
        kernel_forward, kernel_backward = run_forward, bwd

        def run_forward(*args):  # noqa: F811 - `attention` and `fwd` call this one
            out, l, m = kernel_forward(*map(_swap, args[:3]), *args[3:])
            return _swap(out), l, m

        def bwd(residuals, do):  # noqa: F811
            *args, out, l, m = residuals
            grads = kernel_backward((*map(_swap, args[:3]), *args[3:], _swap(out), l, m), _swap(do))
            return (*map(_swap, grads[:3]), *grads[3:])

    attention.defvjp(fwd, bwd)
    return attention


# ----------------------------------------------------------------------------- the two passes, two ways


def _kernel_fwd(causal: bool, scale: float, biased: bool, q, k, v, ab=None):
    if not biased:  # the splash kernel: its statistics are not repeated over 128 lanes
        return tpu_splash.forward(causal, scale, q, k, v)
    from jax.experimental.pallas.ops.tpu import flash_attention as pallas

    sizes = pallas.BlockSizes.get_default(*q.shape[:3], k.shape[2], q.shape[3])
    out, (*_, l, m) = pallas._flash_attention_fwd(q, k, v, ab if biased else None, None, False, causal, scale,
                                                   sizes, False)
    return out, l, m


def _kernel_bwd(causal: bool, scale: float, biased: bool, q, k, v, *rest):
    from jax.experimental.pallas.ops.tpu import flash_attention as pallas

    ab, (out, l, m, do) = (rest[0], rest[1:]) if biased else (None, rest)
    if not biased:
        return tpu_splash.backward(causal, scale, q, k, v, out, l, m, do)
    sizes = pallas.BlockSizes.get_default(*q.shape[:3], k.shape[2], q.shape[3])
    dq, dk, dv, dab, _ = pallas._flash_attention_bwd(False, causal, scale, sizes, False,
                                                     (q, k, v, ab, None, out, l, m), do)
    return (dq, dk, dv, dab) if biased else (dq, dk, dv)


def _logits(causal: bool, scale: float, q, k, ab=None):
    """The kernel's float32 logits: ``(q.k + ab) * scale``, masked with its fill."""
    s = jnp.einsum("bnth,bnsh->bnts", q, k, preferred_element_type=jnp.float32)
    if ab is not None:
        s = s + ab.astype(jnp.float32)
    s = s * scale
    if causal:
        t, length = s.shape[-2:]
        s = s + jnp.where(jnp.tril(jnp.ones((t, length), bool)), 0.0, _MASK_VALUE)
    return s


def _xla_fwd(causal: bool, scale: float, biased: bool, q, k, v, ab=None):
    """What the kernel's forward pass computes, as XLA ops (for a program on several devices)."""
    s = _logits(causal, scale, q, k, ab if biased else None)
    m = jnp.max(s, axis=-1)
    p = jnp.exp(s - m[..., None])
    l = jnp.sum(p, axis=-1)
    out = jnp.einsum("bnts,bnsh->bnth", (p / l[..., None]).astype(v.dtype), v, preferred_element_type=jnp.float32)
    return out.astype(q.dtype), l, m


def _xla_bwd(causal: bool, scale: float, biased: bool, q, k, v, *rest):
    """The kernel's backward pass as XLA ops, with its dtypes: products of half operands
    accumulated in float32, the softmax's derivative in float32."""
    ab, (out, l, m, do) = (rest[0], rest[1:]) if biased else (None, rest)
    p = jnp.exp(_logits(causal, scale, q, k, ab) - m[..., None]) / l[..., None]
    dv = jnp.einsum("bnts,bnth->bnsh", p.astype(do.dtype), do, preferred_element_type=jnp.float32)
    dp = jnp.einsum("bnth,bnsh->bnts", do, v, preferred_element_type=jnp.float32)
    di = jnp.sum(out.astype(jnp.float32) * do.astype(jnp.float32), axis=-1)
    dab = p * (dp - di[..., None]) * scale  # the gradient of q.k + ab
    half = dab.astype(q.dtype)
    dq = jnp.einsum("bnts,bnsh->bnth", half, k, preferred_element_type=jnp.float32)
    dk = jnp.einsum("bnts,bnth->bnsh", half, q, preferred_element_type=jnp.float32)
    grads = (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype))
    return (*grads, dab.astype(ab.dtype)) if biased else grads


# ----------------------------------------------------------------------------- one device or more


one_device_p = Primitive("precision_tpu_flash_attention")
one_device_p.multiple_results = True


@one_device_p.def_impl
def _impl(*args, kernel, fallback, folds=True):
    """Outside ``jit``: compiled for the one device it runs on."""
    return jax.jit(lambda *a: one_device_p.bind(*a, kernel=kernel, fallback=fallback, folds=folds))(*args)


@one_device_p.def_abstract_eval
def _abstract(*avals, kernel, fallback, folds=True):
    del kernel, folds
    return [jax.core.ShapedArray(s.shape, s.dtype) for s in jax.eval_shape(fallback, *avals)]


def _devices(ctx: Any) -> int:
    """How many devices the program being lowered is split over (axes manual under
    ``shard_map`` excluded); unknown counts as more than one."""
    from jax._src import sharding_impls

    context = ctx.module_context.axis_context
    if isinstance(context, sharding_impls.ShardingContext):
        return context.num_devices
    if isinstance(context, sharding_impls.SPMDAxisContext):
        manual = set(context.manual_axes)
        return math.prod(size for name, size in context.mesh.shape.items() if name not in manual)
    return 2


def _lower(ctx: Any, *args: Any, kernel: Callable, fallback: Callable, folds: bool = True) -> Any:
    del folds
    chosen = kernel if _devices(ctx) == 1 else fallback
    return mlir.lower_fun(lambda *a: tuple(chosen(*a)), multiple_results=True)(ctx, *args)


def _batched(args: Any, dims: Any, *, kernel: Callable, fallback: Callable, folds: bool = True) -> Any:
    """vmap: the mapped dimension folded into the batch (every operand and result leads with it);
    ``folds=False`` (operands that have no batch to fold into): the fallback, mapped."""
    if not folds:
        moved = [a if d is None else jnp.moveaxis(a, d, 0) for a, d in zip(args, dims)]
        outs = jax.vmap(fallback, in_axes=[None if d is None else 0 for d in dims])(*moved)
        return list(outs), [0] * len(outs)
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
    front = [jnp.broadcast_to(a, (size, *a.shape)) if d is None else jnp.moveaxis(a, d, 0)
             for a, d in zip(args, dims)]
    outs = one_device_p.bind(*[a.reshape((-1, *a.shape[2:])) for a in front], kernel=kernel, fallback=fallback)
    return [o.reshape((size, -1, *o.shape[1:])) for o in outs], [0] * len(outs)


mlir.register_lowering(one_device_p, _lower)
batching.primitive_batchers[one_device_p] = _batched


def on_one_device(kernel: Callable, fallback: Callable, *args: Any, folds: bool = True) -> list:
    """``kernel(*args)`` where the program is lowered for one device, else ``fallback(*args)`` (both
    return lists of arrays; ``fallback`` gives the shapes). ``folds``: under ``vmap`` the mapped axis
    is folded into the arrays' first (batch) axis, else the fallback is mapped."""
    return one_device_p.bind(*args, kernel=kernel, fallback=fallback, folds=folds)


#: How a pass is chosen (a name tests replace: Pallas's interpret mode, which runs the kernel on a
#: CPU, calls back into Python, an effect this primitive does not carry).
choose = one_device_p.bind
