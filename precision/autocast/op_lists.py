"""Which JAX primitives run in the compute dtype, which stay float32, which follow.

Autocast (:func:`precision.autocast`) sorts every primitive of a traced program
into one of these classes, as PyTorch autocast and Paddle AMP do with ops
(seed 001's white and black lists):

- ``allow``: matrix products and convolutions, where half precision pays off
  (tensor cores) and accumulation stays float32 inside the unit. Their
  floating operands are cast to the compute dtype whatever dtype they arrive
  in, so a layer's pinned ``dtype=float32`` cannot keep them in float32.
- ``deny``: ops whose float16/bfloat16 result is inaccurate or overflows:
  exponentials and logarithms (softmax, log-softmax, the loss), powers and
  roots (norms' ``rsqrt(var)``), trigonometry, special functions, and sums
  and products over many elements (means, variances, cumulative sums). They
  run in float32.
- everything else follows its inputs (``max``, ``add``, ``tanh``, reshapes...).

Users move primitives between the classes with :func:`op_lists`, by name
(``"exp"``, ``"dot_general"``): ``op_lists(deny=["tanh"], follow=["reduce_sum"])``.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import functools
from typing import Iterable

from precision.policy import PolicyError

__all__ = ["OpClass", "OpLists", "ALLOW", "DENY", "op_lists"]


class OpClass(enum.Enum):
    """How autocast treats one primitive."""

    ALLOW = "allow"  # operands cast to the compute dtype
    DENY = "deny"  # operands cast to float32
    FOLLOW = "follow"  # floating operands brought to one dtype, from their kinds
    EACH = "each"  # each operand passes through in its own dtype (collectives, barriers)
    ORIGINAL = "original"  # run exactly as traced: dtype-sensitive or unknown primitives


#: Primitives run in the compute dtype.
ALLOW = frozenset({"dot_general", "conv_general_dilated", "ragged_dot_general"})

#: Primitives run in float32.
DENY = frozenset({
    "exp", "exp2", "expm1", "log", "log1p", "log2", "pow", "sqrt", "rsqrt", "cbrt",
    "sin", "cos", "tan", "asin", "acos", "atan", "atan2", "sinh", "cosh", "asinh", "acosh", "atanh",
    "lgamma", "digamma", "igamma", "igammac", "igamma_grad_a", "random_gamma_grad", "erf_inv",
    "bessel_i0e", "bessel_i1e", "polygamma", "zeta", "regularized_incomplete_beta",
    "reduce_sum", "reduce_prod", "cumsum", "cumprod", "cumlogsumexp", "reduce_window_sum",
})

#: Primitives whose floating operands are unified and follow the inputs.
_FOLLOW = frozenset({
    "add", "sub", "mul", "div", "rem", "neg", "sign", "floor", "ceil", "round", "is_finite", "abs",
    "max", "min", "square", "integer_pow", "logistic", "tanh", "erf", "erfc", "one_minus_square",
    "select_n", "clamp", "eq", "ne", "lt", "le", "gt", "ge", "reduce_precision",
    "broadcast_in_dim", "reshape", "squeeze", "transpose", "rev", "slice", "dynamic_slice",
    "dynamic_update_slice", "gather", "concatenate", "pad", "split",
    "reduce_max", "reduce_min", "argmax", "argmin", "cummax", "cummin",
    "reduce_window_max", "reduce_window_min", "sort", "top_k", "stop_gradient",
    "scatter", "scatter-add", "scatter-sub", "scatter-mul", "scatter-min", "scatter-max",
})

#: Primitives whose operands pass through each in its own dtype.
_EACH = frozenset({
    "copy", "copy_p", "optimization_barrier", "sharding_constraint", "mesh_cast", "reshard", "name",
    "device_put", "psum", "psum_invariant", "pmax", "pmin", "ppermute", "all_gather", "all_to_all",
    "reduce_scatter", "psum_scatter", "pvary", "pbroadcast",
})

_KNOWN_ORIGINAL = frozenset({
    "bitcast_convert_type", "nextafter", "reduce", "reduce_window", "select_and_scatter_add",
    "select_and_gather_add", "real", "imag", "complex", "conj", "debug_callback", "pure_callback",
    "io_callback", "convert_element_type",
})


@functools.cache
def _registered_primitive_names() -> frozenset[str]:
    """Names of every JAX primitive object alive (for validating user lists)."""
    import gc

    from jax.extend.core import Primitive

    return frozenset(o.name for o in gc.get_objects() if isinstance(o, Primitive))


def _known(name: str) -> bool:
    return (name in ALLOW or name in DENY or name in _FOLLOW or name in _EACH or name in _KNOWN_ORIGINAL
            or name in _registered_primitive_names())


@dataclasses.dataclass(frozen=True)
class OpLists:
    """The allow and deny lists autocast uses (hashable, so it can key caches).

    ``follow`` names primitives taken out of the default allow/deny lists;
    ``fuse_attention``: softmax attention written out in a half-precision region
    becomes one fused attention call (cuDNN's where lowered for CUDA);
    ``fuse_norms``: layer, RMS and batch norms written out get their backward in closed form
    (:mod:`precision.autocast.norm_fusion`: fewer, larger kernels; the same forward);
    ``split_projections``: a fused projection split after its matmul (a query, key and value
    made by one matmul) is one matmul per part where lowered for a TPU
    (:mod:`precision.autocast.projection_split`: no copies to lay the parts out);
    ``blockwise_loss``: whether a train step computes a loss from large logits a block of
    rows at a time (:func:`precision.blockwise_loss`): ``"auto"`` from logits of
    :data:`precision.blockwise.AUTO_MIN_LOGITS_BYTES` (8 GiB in float32), ``"on"`` from
    :data:`precision.blockwise.MIN_LOGITS_BYTES` (256 MiB), ``"off"``.
    Build one with :func:`op_lists`.
    """

    allow: frozenset[str] = ALLOW
    deny: frozenset[str] = DENY
    follow: frozenset[str] = frozenset()
    fuse_attention: bool = True
    blockwise_loss: str = "auto"
    fuse_norms: bool = True
    split_projections: bool = True

    def classify(self, name: str) -> OpClass:
        """The class of primitive ``name`` under these lists."""
        if name in self.allow:
            return OpClass.ALLOW
        if name in self.deny:
            return OpClass.DENY
        if name in _FOLLOW or name in self.follow:
            return OpClass.FOLLOW
        if name in _EACH:
            return OpClass.EACH
        return OpClass.ORIGINAL


def _names(arg: Iterable[str] | str | None, what: str) -> frozenset[str]:
    if arg is None:
        return frozenset()
    if isinstance(arg, str):
        arg = [arg]
    out = set()
    for item in arg:
        name = getattr(item, "name", item)  # a Primitive object or its name
        if not isinstance(name, str) or not _known(name):
            choices = sorted(ALLOW | DENY | _FOLLOW | _EACH)
            close = difflib.get_close_matches(str(name), choices, n=3, cutoff=0.6)
            hint = f" Did you mean {', '.join(map(repr, close))}?" if close else ""
            raise PolicyError(
                f"{what}: {name!r} is not the name of a JAX primitive.{hint} Use primitive names as they "
                f"appear in jax.make_jaxpr, e.g. 'dot_general', 'conv_general_dilated', 'exp', 'reduce_sum'.")
        out.add(name)
    return frozenset(out)


def op_lists(allow: Iterable[str] | str | None = None, deny: Iterable[str] | str | None = None,
             follow: Iterable[str] | str | None = None, *, fuse_attention: bool | None = None,
             blockwise_loss: bool | str | None = None, fuse_norms: bool | None = None,
             split_projections: bool | None = None, base: OpLists | None = None) -> OpLists:
    """The default lists (or ``base``) with primitives moved between classes.

    Args:
      allow: primitives to run in the compute dtype (Paddle's ``custom_white_list``).
      deny: primitives to keep in float32 (Paddle's ``custom_black_list``).
      follow: primitives to take out of both lists: they follow their inputs.
      fuse_attention: ``False`` leaves softmax attention written out in a model
        (Flax's ``dot_product_attention``, einsum-softmax-einsum) as it is, op by op;
        by default (``None``: ``base``'s, else ``True``) it becomes one fused attention
        call where that is the same computation (see ``docs/fused-attention.md``).
      blockwise_loss: whether a train step computes a loss from large logits a block of
        rows at a time (:func:`precision.blockwise_loss`, ``docs/blockwise-loss.md``):
        ``"auto"`` (``None``: ``base``'s, else ``"auto"``) from 8 GiB of float32 logits,
        where their memory limits the batch; ``True`` / ``"on"`` from 256 MiB
        (less memory, one more pass of the head's matmul); ``False`` / ``"off"`` never.
      fuse_norms: ``False`` leaves layer, RMS and batch norms written out differentiated op by op;
        by default (``None``: ``base``'s, else ``True``) their backward is computed in
        closed form, in fewer kernels (the forward is unchanged).
      split_projections: ``False`` leaves a fused projection split after its matmul (one
        matmul making the query, key and value) as one matmul on a TPU too; by default
        (``None``: ``base``'s, else ``True``) a program lowered for one TPU makes each part
        with a matmul of its own (the same values; no layout copies).

    A name may appear in only one argument. Names are JAX primitive names
    (``jax.make_jaxpr`` shows them); an unknown name raises :class:`PolicyError`.
    """
    allow_set, deny_set, follow_set = _names(allow, "allow"), _names(deny, "deny"), _names(follow, "follow")
    for a, b, an, bn in ((allow_set, deny_set, "allow", "deny"), (allow_set, follow_set, "allow", "follow"),
                         (deny_set, follow_set, "deny", "follow")):
        both = a & b
        if both:
            raise PolicyError(f"op_lists: {sorted(both)} given both as {an} and as {bn}; name each primitive once")
    base = base or OpLists()
    return OpLists(allow=(base.allow - deny_set - follow_set) | allow_set,
                   deny=(base.deny - allow_set - follow_set) | deny_set,
                   follow=(base.follow - allow_set - deny_set) | follow_set,
                   fuse_attention=base.fuse_attention if fuse_attention is None else bool(fuse_attention),
                   blockwise_loss=base.blockwise_loss if blockwise_loss is None else _blockwise_mode(blockwise_loss),
                   fuse_norms=base.fuse_norms if fuse_norms is None else bool(fuse_norms),
                   split_projections=base.split_projections if split_projections is None else bool(split_projections))


def _blockwise_mode(value: bool | str) -> str:
    """``"auto"``, ``"on"`` or ``"off"`` from a flag or one of those names."""
    if isinstance(value, bool):
        return "on" if value else "off"
    if value in ("auto", "on", "off"):
        return value
    raise PolicyError(f"op_lists: blockwise_loss={value!r}; valid: 'auto', True ('on'), False ('off')")
