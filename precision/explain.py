"""What a policy did to a model: ``precision.explain(model, x, policy="mixed_bf16")``.

Traces the model (or any function) under its policy, abstractly (nothing is
computed), and reads the program that results, forward and backward:

- per module path, the dtype its params are stored in, the dtype of each
  matmul/convolution and the share of its FLOPs in half precision;
- every float32 island and why it is float32 (a deny-listed op, what only
  feeds one, an upcast written in the model, a rule);
- matmul/conv FLOPs in float32 for any other reason, by module: a policy that
  does not reach them (``autocast=False`` with pinned layer dtypes, an opaque
  primitive). :func:`check_coverage` warns, or raises, when they exceed 5%.
- under an FP8 (int8) policy, the share of matmul FLOPs in FP8 (int8), in
  16-bit and in float32 per module, and why a matmul is not 8-bit (below
  ``min_size``, a rule, attention, a convolution under FP8);
- the precision of each module's float32 matmuls, where a policy or rule asks for
  one other than XLA's default (``matmul=highest``: true float32, not TF32).
"""

from __future__ import annotations

import collections
import dataclasses
import warnings
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from precision.autocast.norm_fusion import AS_WRITTEN
from precision.autocast.op_lists import OpLists
from precision.autocast.program import MATMUL_PRIMITIVES, MatmulOp, matmul_ops
from precision.autocast.values import REGION
from precision.explain_table import (NOT_FUSED, Island, attention_lines, attention_reports, columns, coverage_text,
                                    f32_precision, flops_by_precision, fp8_rows, half_flops as _flops, islands,
                                    norm_lines, norm_reports, precision_column, precision_line, share_text,
                                    short_dtype as _short)
from precision.explain_trace import Traced, trace_function, trace_linen, trace_nnx
from precision.fp8 import Fp8Options, as_fp8_options
from precision.int8 import Int8Options, as_int8_options
from precision.modules import LinenWithPolicy, NNXWithPolicy, with_policy
from precision.policy import Policy, PolicyError, get_policy

__all__ = ["explain", "Explanation", "ModuleReport", "Island", "check_coverage", "PrecisionWarning",
           "CoverageError"]

RULE = "a rule keeps it in float32"
NOT_REACHED = "not reached by the policy"
AUTOCAST_OFF = "pinned layer dtype left alone (autocast=False)"


class PrecisionWarning(UserWarning):
    """A half-precision policy leaves much of a model's matmul/conv work in float32."""


class CoverageError(PolicyError):
    """``strict`` coverage: a half-precision policy leaves matmul/conv FLOPs in float32."""


class ModuleReport(NamedTuple):
    """One module path: stored param dtypes and its matmul/conv FLOPs by dtype."""

    path: str
    param_dtypes: tuple[str, ...]
    matmul_dtypes: tuple[str, ...]  # of its matmuls/convs, forward
    half_flops: float  # forward and backward, operands below 32 bits (fp8 included)
    total_flops: float
    f32_reason: str  # why its float32 matmul FLOPs are float32 ("" if none)
    fp8_flops: float = 0.0  # forward and backward, fp8 operands
    not_fp8_reason: str = ""  # under an FP8 (int8) policy: why some of its matmuls are not fp8 (int8)
    fp8_recipe: str = ""  # how its fp8 (int8) matmuls are scaled ("current scaling", "row and column scales"...)
    f32_precision: str = ""  # of its float32 matmuls ("highest"...) where not all at XLA's default
    int8_flops: float = 0.0  # forward and backward, int8 operands

    @property
    def half_share(self) -> float:
        return self.half_flops / self.total_flops if self.total_flops else float("nan")

    @property
    def fp8_share(self) -> float:
        return self.fp8_flops / self.total_flops if self.total_flops else float("nan")

    @property
    def int8_share(self) -> float:
        return self.int8_flops / self.total_flops if self.total_flops else float("nan")


@dataclasses.dataclass(frozen=True)
class Explanation:
    """The result of :func:`explain`; ``print(explanation)`` shows it as a table."""

    name: str
    policy: Policy
    autocast: bool
    modules: tuple[ModuleReport, ...]
    islands: tuple[Island, ...]
    forward: tuple[float, float]  # (half FLOPs, all matmul/conv FLOPs)
    backward: tuple[float, float] | None
    fp8: tuple[float, float] = (0.0, 0.0)  # fp8 FLOPs (forward, backward)
    attention: tuple[tuple[str, str], ...] = ()  # (module, fused how or why not), per softmax attention
    f32_flops_by_precision: tuple[tuple[str, float], ...] = ()  # float32 matmul FLOPs (fwd + bwd) per precision
    int8: tuple[float, float] = (0.0, 0.0)  # int8 FLOPs (forward, backward)
    norms: tuple[tuple[str, str], ...] = ()  # (module, its kind and how differentiated, or why as written), per norm

    @property
    def fused_attention(self) -> tuple[str, ...]:
        """The modules whose softmax attention runs fused (cuDNN's where lowered for CUDA, the
        Pallas flash attention where lowered for TPU)."""
        return tuple(path for path, how in self.attention if not how.startswith(NOT_FUSED))

    @property
    def closed_form_norms(self) -> tuple[str, ...]:
        """The modules whose layer, RMS or batch norm is differentiated in closed form
        (:mod:`precision.autocast.norm_fusion`)."""
        return tuple(path for path, how in self.norms if AS_WRITTEN not in how)

    @property
    def fp8_share(self) -> float:
        """Share of matmul/conv FLOPs (forward and backward) with fp8 operands."""
        total = self.forward[1] + (self.backward[1] if self.backward else 0.0)
        return sum(self.fp8) / total if total else float("nan")

    @property
    def int8_share(self) -> float:
        """Share of matmul/conv FLOPs (forward and backward) with int8 operands."""
        total = self.forward[1] + (self.backward[1] if self.backward else 0.0)
        return sum(self.int8) / total if total else float("nan")

    @property
    def half_share(self) -> float:
        """Share of matmul/conv FLOPs (forward and backward) with half-precision operands."""
        half = self.forward[0] + (self.backward[0] if self.backward else 0.0)
        total = self.forward[1] + (self.backward[1] if self.backward else 0.0)
        return half / total if total else float("nan")

    @property
    def uncovered(self) -> dict[str, float]:
        """Float32 matmul/conv FLOPs by module that neither the policy nor a rule asked for."""
        if self.policy.compute_dtype == np.dtype(np.float32):
            return {}
        return {m.path: m.total_flops - m.half_flops for m in self.modules
                if m.total_flops > m.half_flops and m.f32_reason != RULE}

    @property
    def uncovered_share(self) -> float:
        total = sum(m.total_flops for m in self.modules)
        return sum(self.uncovered.values()) / total if total else 0.0

    @property
    def fp8_coverage(self) -> str:
        """``"fp8 covers 0% of matmul FLOPs (all below fp8 min_size 1024)"``: the FP8 share,
        and why the rest is not FP8 (each reason once, without its sizes)."""
        return coverage_text(self.fp8_share, [m.not_fp8_reason for m in self.modules
                                              if m.total_flops > m.fp8_flops and m.not_fp8_reason])

    @property
    def int8_coverage(self) -> str:
        """``"int8 covers 97% of matmul FLOPs (the rest: attention stays out of int8)"``: the int8
        share, and why the rest is not int8 (each reason once, without its sizes)."""
        return coverage_text(self.int8_share, [m.not_fp8_reason for m in self.modules
                                               if m.total_flops > m.int8_flops and m.not_fp8_reason], "int8")

    @property
    def shows_fp8(self) -> bool:
        """The policy, a rule or a region put matmuls in FP8: the table shows FP8 shares."""
        return self.policy.fp8 or sum(self.fp8) > 0

    @property
    def shows_int8(self) -> bool:
        """The policy, a rule or a region put matmuls in int8: the table shows int8 shares."""
        return self.policy.int8 or sum(self.int8) > 0

    def table(self) -> str:
        """The explanation as a text table."""
        lines = [f"precision.explain: {self.name} under {self.policy} "
                 f"({'autocast' if self.autocast else 'module casts only'})",
                 "matmul/conv FLOPs with half-precision operands: " + share_text("forward", self.forward)
                 + ("; " + share_text("backward", self.backward) if self.backward else "")]
        lines += precision_line(dict(self.f32_flops_by_precision))
        if self.shows_fp8 or self.shows_int8:
            name, flops = ("int8", self.int8) if self.shows_int8 and not self.shows_fp8 else ("fp8", self.fp8)
            lines.append(f"matmul/conv FLOPs with {name} operands: "
                         + share_text("forward", (flops[0], self.forward[1]))
                         + ("; " + share_text("backward", (flops[1], self.backward[1])) if self.backward else ""))
            lines.append(self.int8_coverage if name == "int8" else self.fp8_coverage)
            lines += columns(precision_column(fp8_rows(self.modules, name), self.modules))
        else:
            rows = [("module", "params", "matmul/conv", "half", "float32 because")]
            for m in self.modules:
                share = "" if not m.total_flops else f"{100 * m.half_share:.0f}%"
                rows.append((m.path or "(top)", ",".join(m.param_dtypes), ",".join(m.matmul_dtypes), share,
                             m.f32_reason))
            lines += columns(precision_column(rows, self.modules))
        lines += attention_lines(self.attention)
        lines += norm_lines(self.norms)
        if self.islands:
            lines.append("float32 islands:")
            for island in self.islands:
                ops = ", ".join(f"{p}" + (f" x{n}" if n > 1 else "") for p, n in island.primitives)
                lines.append(f"  {island.path or '(top)'}: {ops}  [{island.reason}]")
        return "\n".join(lines)

    __str__ = table

    def __repr__(self) -> str:
        return self.table()


def _wrap(target: Any, policy: Any, rules: Any, ops: OpLists | None, autocast: bool, fp8: Any, int8: Any) -> Any:
    if isinstance(target, (LinenWithPolicy, NNXWithPolicy)):
        if policy is not None and get_policy(policy) != target.policy:
            raise ValueError(f"explain: policy {policy!r} differs from the wrapped model's {target.policy}; "
                             "pass policy=None or the unwrapped module")
        if fp8 is not None and as_fp8_options(fp8) != target.fp8:
            raise ValueError(f"explain: fp8={fp8!r} differs from the wrapped model's {target.fp8}; pass fp8=None")
        if int8 is not None and as_int8_options(int8) != target.int8:
            raise ValueError(f"explain: int8={int8!r} differs from the wrapped model's {target.int8}; pass int8=None")
        return target
    if policy is None:
        raise TypeError("explain: pass policy=... (a spec or preset) for an unwrapped model or function")
    if isinstance(target, nn.Module):
        return with_policy(target, policy, rules, autocast=autocast, ops=ops, fp8=fp8, int8=int8)
    if isinstance(target, nnx.Module):
        return with_policy(nnx.clone(target), policy, rules, autocast=autocast, ops=ops, fp8=fp8, int8=int8)
    if callable(target):
        return target
    raise TypeError(f"explain expects a Flax Linen or NNX module, a with_policy wrapper or a function, "
                    f"got {type(target).__name__}")


def explain(target: Any, *args: Any, policy: "str | Policy | None" = None, rules: Any = None,
            ops: OpLists | None = None, autocast: bool = True, backward: bool = True,
            fp8: "Fp8Options | dict | None" = None, int8: "Int8Options | dict | None" = None,
            **kwargs: Any) -> Explanation:
    """Explains what ``policy`` does to ``target`` called on ``args`` (traced, not run).

    Args:
      target: a Linen or NNX module (wrapped with ``policy`` and ``rules`` as
        :func:`precision.with_policy` would), a ``with_policy`` wrapper (its own
        policy), or a function of arrays (run under :func:`precision.autocast`).
      *args, **kwargs: sample inputs and call arguments (``train=True``...).
        Only shapes and dtypes matter. A Linen model gets a dropout key unless
        ``rngs=`` is given.
      backward: also trace the backward pass (gradients with respect to the
        params, or the floating arguments of a function).
      fp8: :func:`precision.fp8_options` for an FP8 policy (as
        :func:`precision.with_policy` takes them).
      int8: :func:`precision.int8_options` for an int8 policy (likewise).

    Returns an :class:`Explanation`: ``print`` it for the table, or read
    ``half_share``, ``modules``, ``islands`` and ``uncovered``.
    """
    wrapped = _wrap(target, policy, rules, ops, autocast, fp8, int8)
    # NumPy inputs as JAX arrays, as a jitted step passes them (a model may accept only those)
    args, kwargs = jax.tree_util.tree_map(lambda x: jnp.asarray(x) if isinstance(x, np.ndarray) else x,
                                          (args, kwargs))
    if isinstance(wrapped, LinenWithPolicy):
        traced = trace_linen(wrapped, args, kwargs, backward)
        policy_, on = wrapped.policy, wrapped.autocast
    elif isinstance(wrapped, NNXWithPolicy):
        traced = trace_nnx(wrapped, args, kwargs, backward)
        policy_, on = wrapped.policy, wrapped.autocast
    else:
        policy_, on = get_policy(policy), True
        traced = trace_function(wrapped, policy_, ops or OpLists(), args, kwargs, backward, as_fp8_options(fp8),
                                 as_int8_options(int8))
    return _summarize(traced, policy_, on)


def _path(path: tuple[str, ...], root: str) -> str:
    if root and path and path[0] == root:
        path = path[1:]
    return "/".join(path)


def _summarize(traced: Traced, policy: Policy, autocast: bool) -> Explanation:
    forward = matmul_ops(traced.forward)
    backward = [m for m in matmul_ops(traced.backward) if m.backward] if traced.backward is not None else None
    reasons = {(_path(r.path, traced.root), r.primitive): r.reason for r in traced.log
               if r.primitive in MATMUL_PRIMITIVES and r.dtype == np.dtype(np.float32)}
    not_fp8: dict[str, str] = {}
    recipes: dict[str, str] = {}
    for r in (r for r in traced.log if r.primitive in MATMUL_PRIMITIVES):
        if r.dtype.itemsize > 1:
            not_fp8.setdefault(_path(r.path, traced.root), r.reason)
        else:  # an fp8 (int8) matmul logs "fp8 matmul (<its recipe>)" ("int8 matmul (...)")
            recipe = r.reason.partition(" matmul (")[2].removesuffix(")")
            recipes.setdefault(_path(r.path, traced.root), recipe)
    by_path: dict[str, list[MatmulOp]] = collections.defaultdict(list)
    for m in forward + (backward or []):
        by_path[_path(m.path, traced.root)].append(m)
    paths = sorted(set(by_path) | set(traced.params))
    modules = []
    for path in paths:
        ops = by_path.get(path, [])
        half = sum(m.flops for m in ops if m.half)
        total = sum(m.flops for m in ops)
        reason = ""
        if total > half:
            f32_prims = {m.primitive for m in ops if not m.half}
            logged = {reasons.get((path, p)) for p in f32_prims}
            reason = (RULE if REGION in logged else AUTOCAST_OFF if not autocast
                      else next((r for r in logged if r), NOT_REACHED))
        dtypes = tuple(dict.fromkeys(_short(m.dtype.name) for m in ops if not m.backward))
        eight = sum(m.flops for m in ops if m.fp8 or m.int8)
        modules.append(ModuleReport(path, traced.params.get(path, ()), dtypes, half, total, reason,
                                    sum(m.flops for m in ops if m.fp8), not_fp8.get(path, "") if total > eight else "",
                                    recipes.get(path, "") if eight else "", f32_precision(ops),
                                    sum(m.flops for m in ops if m.int8)))
    fp8_flops = (sum(m.flops for m in forward if m.fp8), sum(m.flops for m in backward or [] if m.fp8))
    int8_flops = (sum(m.flops for m in forward if m.int8), sum(m.flops for m in backward or [] if m.int8))
    path_of = lambda p: _path(p, traced.root)  # noqa: E731
    return Explanation(traced.name, policy, autocast, tuple(modules), islands(traced.log, path_of),
                       _flops(forward), _flops(backward) if backward is not None else None, fp8_flops,
                       attention_reports(traced.log, path_of), flops_by_precision(forward + (backward or [])),
                       int8_flops, norm_reports(traced.log, path_of))


def check_coverage(explanation: Explanation, *, threshold: float = 0.05, strict: bool = False,
                   stacklevel: int = 2) -> None:
    """Warns (``strict``: raises :class:`CoverageError`) when a half-compute policy
    leaves more than ``threshold`` of matmul/conv FLOPs in float32 for reasons
    other than a rule, naming the modules."""
    if explanation.policy.compute_dtype == np.dtype(np.float32):
        return
    share = explanation.uncovered_share
    if share <= threshold:
        return
    worst = sorted(explanation.uncovered.items(), key=lambda kv: -kv[1])
    reasons = {m.path: m.f32_reason for m in explanation.modules}
    named = "; ".join(f"{p or '(top)'} ({reasons[p]})" for p, _ in worst[:8])
    more = f" and {len(worst) - 8} more" if len(worst) > 8 else ""
    message = (f"policy {explanation.policy} leaves {100 * share:.0f}% of the matmul/conv FLOPs of "
               f"{explanation.name} in float32 (more than {100 * threshold:.0f}%): {named}{more}. "
               f"precision.explain(...) shows every module.")
    if strict:
        raise CoverageError(message)
    warnings.warn(message, PrecisionWarning, stacklevel=stacklevel)
