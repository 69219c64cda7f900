"""Reading a traced program: every equation with its module path, and the
FLOPs and operand dtypes of its matmuls and convolutions.

Walks a jaxpr into every sub-program (jit, scan, while, cond, remat,
custom_jvp/vjp, shard_map...), so what it reports is what the program as a
whole computes: a scan over 12 layers counts its body 12 times.
"""

from __future__ import annotations

import math
from typing import Any, Iterator, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from precision.autocast.matmul_precision import precision_name
from precision.autocast.regions import module_path, scope_names

__all__ = ["Op", "binders", "retyped_update_jaxpr", "iter_ops", "MatmulOp", "matmul_ops", "matmul_flops", "MATMUL_PRIMITIVES", "HALF_DTYPES",
           "MOVES", "platform_branch", "host_platform", "scan_counts"]

MATMUL_PRIMITIVES = ("dot_general", "conv_general_dilated", "ragged_dot_general")
HALF_DTYPES = frozenset(np.dtype(d) for d in ("float16", "bfloat16"))
#: Primitives whose output holds their (first) operand's values, moved around: casting before
#: or after them gives the same result, and a param through them is still that param.
MOVES = frozenset({"reshape", "transpose", "broadcast_in_dim", "squeeze", "slice", "dynamic_slice", "rev", "copy",
                   "sharding_constraint"})


class Op(NamedTuple):
    """One equation of a program, where it sits and how often it runs."""

    eqn: Any
    path: tuple[str, ...]  # named scopes (module path), region tags dropped
    backward: bool  # computed by a transpose (the backward pass)
    repeat: float  # times it runs per call of the program (loop trip counts)

    @property
    def primitive(self) -> str:
        return self.eqn.primitive.name

    @property
    def in_dtypes(self) -> tuple[np.dtype, ...]:
        return tuple(np.dtype(v.aval.dtype) for v in self.eqn.invars if hasattr(v.aval, "dtype"))

    @property
    def out_dtypes(self) -> tuple[np.dtype, ...]:
        return tuple(np.dtype(v.aval.dtype) for v in self.eqn.outvars if hasattr(v.aval, "dtype"))


def binders(jaxpr: Any) -> list[Any]:
    """A program's constvars then invars (``Jaxpr.all_invars`` where JAX has it)."""
    return list(jaxpr.all_invars) if hasattr(jaxpr, "all_invars") else [*jaxpr.constvars, *jaxpr.invars]


def scan_counts(params: dict) -> tuple[int, int]:
    """How many of a ``scan``'s operands are its constants and its carry (the rest: what it slices):
    ``num_consts`` and ``num_carry`` before jax 0.11, the first two parts of ``ft_in`` since."""
    if "num_consts" in params:
        return params["num_consts"], params["num_carry"]
    consts, carry, _ = params["ft_in"].unpack()
    return len(consts), len(carry)


def platform_branch(eqn: Any, platform: str | None) -> int | None:
    """For a ``cond`` made by ``jax.lax.platform_dependent``, the branch a program
    lowered for ``platform`` (``"cpu"``, ``"cuda"``...; ``None``: a platform no
    branch names) keeps; ``None`` for any other equation."""
    platforms = eqn.params.get("branches_platforms") if eqn.primitive.name == "cond" else None
    if platforms is None:
        return None
    for i, names in enumerate(platforms):
        if names is None or (platform is not None and platform in names):
            return i
    return None


def host_platform() -> str:
    """The lowering platform of this process's default devices: ``cpu``, ``cuda``, ``rocm`` or ``tpu``."""
    platform = jax.default_backend()
    if platform == "gpu":
        version = str(getattr(jax.devices()[0].client, "platform_version", "")).lower()
        return "rocm" if "rocm" in version else "cuda"
    return platform


def _sub_jaxprs(eqn: Any) -> Iterator[tuple[Any, float]]:
    """(jaxpr, runs per run of ``eqn``) of each sub-program of ``eqn``; of a
    platform-dependent ``cond``, only the branch for platforms it does not name
    (the portable program: what the model computes, not a library's kernel)."""
    name = eqn.primitive.name
    times = float(eqn.params.get("length", 1)) if name == "scan" else 1.0
    if name == "shard_map" and "mesh" in eqn.params:
        times = float(getattr(eqn.params["mesh"], "size", 1))
    branch = platform_branch(eqn, None)
    if branch is not None:
        yield eqn.params["branches"][branch].jaxpr, times
        return
    for key, param in eqn.params.items():
        if name in ("custom_vjp_call", "custom_jvp_call") and key != "call_jaxpr":
            continue
        for item in param if isinstance(param, (tuple, list)) else (param,):
            if hasattr(item, "eqns"):
                yield item, times
            elif hasattr(item, "jaxpr") and hasattr(item.jaxpr, "eqns"):
                yield item.jaxpr, times


def iter_ops(jaxpr: Any, prefix: tuple = (), repeat: float = 1.0, backward: bool = False) -> Iterator[Op]:
    """Every equation of ``jaxpr`` and its sub-programs, outermost first."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr) if not hasattr(jaxpr, "eqns") else jaxpr
    for eqn in jaxpr.eqns:
        stack = getattr(eqn.source_info.name_stack, "stack", ())
        scope = prefix + scope_names(eqn.source_info.name_stack)
        is_backward = backward or any(type(e).__name__ == "Transform" and e.name == "transpose" for e in stack)
        yield Op(eqn, module_path(scope), is_backward, repeat)
        for sub, times in _sub_jaxprs(eqn):
            yield from iter_ops(sub, scope, repeat * times, is_backward)


def matmul_flops(eqn: Any) -> float:
    """FLOPs (2 per multiply-add) of one dot_general, conv or ragged dot."""
    name = eqn.primitive.name
    out = eqn.outvars[0].aval.shape
    if name == "dot_general":
        (lhs_contract, _), _ = eqn.params["dimension_numbers"]
        lhs = eqn.invars[0].aval.shape
        return 2.0 * math.prod(out) * math.prod(lhs[d] for d in lhs_contract)
    if name == "conv_general_dilated":
        rhs = eqn.invars[1].aval.shape
        out_features = rhs[eqn.params["dimension_numbers"].rhs_spec[0]]
        return 2.0 * math.prod(out) * math.prod(rhs) / max(out_features, 1)
    if name == "ragged_dot_general":
        lhs = eqn.invars[0].aval.shape
        return 2.0 * math.prod(out) * lhs[-1]
    return 0.0


class MatmulOp(NamedTuple):
    """A matmul or convolution of a program."""

    primitive: str
    path: tuple[str, ...]
    dtype: np.dtype  # of its floating operands (the widest, if they differ)
    flops: float  # per call of the program
    backward: bool
    precision: str = "default"  # its precision param: default, high, highest, a dot algorithm's name

    @property
    def half(self) -> bool:
        """Operands below 32 bits (float16, bfloat16, fp8, int8)."""
        return (bool(jnp.issubdtype(self.dtype, jnp.floating)) or self.int8) and self.dtype.itemsize < 4

    @property
    def int8(self) -> bool:
        """Int8 operands (an int8 matmul or convolution, accumulating in int32)."""
        return self.dtype == np.dtype(np.int8)

    @property
    def fp8(self) -> bool:
        """FP8 operands (E4M3 or E5M2)."""
        return bool(jnp.issubdtype(self.dtype, jnp.floating)) and self.dtype.itemsize == 1


#: Dot algorithms that round both operands to one half-precision pass, whatever their stored dtypes
#: (JAX's bfloat16 attention computes its backward matmuls with a float32 operand this way).
_HALF_ALGORITHMS = {"BF16_BF16_F32": np.dtype(jnp.bfloat16), "BF16_BF16_BF16": np.dtype(jnp.bfloat16),
                    "F16_F16_F32": np.dtype(np.float16), "F16_F16_F16": np.dtype(np.float16)}


def _algorithm_dtype(eqn: Any) -> np.dtype | None:
    """The operand dtype a dot's ``precision`` algorithm computes in, when it is a half one."""
    return _HALF_ALGORITHMS.get(getattr(eqn.params.get("precision"), "name", None))


def matmul_ops(jaxpr: Any) -> list[MatmulOp]:
    """The matmuls and convolutions of a program, with their operand dtype and FLOPs."""
    found = []
    for op in iter_ops(jaxpr):
        if op.primitive in MATMUL_PRIMITIVES:
            floats = [d for d in op.in_dtypes if jnp.issubdtype(d, jnp.floating)]
            dtype = _algorithm_dtype(op.eqn) or (max(floats, key=lambda d: d.itemsize) if floats else op.in_dtypes[0])
            found.append(MatmulOp(op.primitive, op.path, dtype, matmul_flops(op.eqn) * op.repeat, op.backward,
                                  precision_name(op.eqn.params.get("precision"))))
    return found


def retyped_update_jaxpr(jaxpr: Any, consts: Sequence[Any], dtype: np.dtype) -> dict:
    """A scatter's scalar combiner (its ``update_jaxpr``) traced again for ``dtype`` operands: the
    params a scatter takes when autocast changes its operands' dtype."""
    n = len(jaxpr.invars)
    scalar = jax.ShapeDtypeStruct((), dtype)
    closed = jax.make_jaxpr(lambda *xs: jax.core.eval_jaxpr(jaxpr, list(consts), *xs))(*[scalar] * n)
    return {"update_jaxpr": closed.jaxpr, "update_consts": tuple(closed.consts)}
