"""Where autocast puts a matmul in FP8, and the amax histories it reads.

An allow-listed ``dot_general`` in an FP8 region (the policy's compute is
``f8``, or a rule or :func:`precision.compute_in` says so) becomes
:func:`~precision.autocast.scaled.fp8_matmul.scaled_dot` when each of its M, K, N is
at least ``min_size`` (and, unless ``attention`` is asked, it is not a batched
product of two activations). Under delayed scaling, each such matmul of the
program's top level is a *site* named ``dot_general_<i>`` (the i-th in its
module, in program order) whose histories live at ``state[module path][name]``;
inside a sub-program (loop body, remat, custom derivative rule) the state is
out of reach and the matmul is scaled currently. Every decision is logged for
:func:`precision.explain`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from precision.autocast.scaled.fp8_matmul import Histories, rowwise_dot, scaled_dot
from precision.autocast.scaled.products import attention_or_size, gradient_dtypes
from precision.autocast.values import Kind
from precision.fp8 import Fp8Options

__all__ = ["Fp8Run", "FP8_CURRENT", "FP8_DELAYED", "FP8_NESTED", "FP8_NO_STATE", "FP8_ROWWISE", "BELOW_MIN_SIZE",
           "ATTENTION", "NOT_A_DOT", "NOT_FP8_REGION",
           "fp8_dot", "skip_reason"]

# Reasons logged (the Record's dtype is E4M3 for an FP8 matmul, the fallback otherwise).
FP8_CURRENT = "fp8 matmul (current scaling)"
FP8_DELAYED = "fp8 matmul (delayed scaling)"
FP8_NESTED = "fp8 matmul (current scaling: in a loop, remat or custom rule)"
FP8_NO_STATE = "fp8 matmul (current scaling: no history passed)"
FP8_ROWWISE = "fp8 matmul (rowwise scaling)"
BELOW_MIN_SIZE = "below fp8 min_size"
ATTENTION = "attention stays out of fp8"
NOT_A_DOT = "fp8 takes dot_general only"
NOT_FP8_REGION = "a rule keeps it out of fp8"


@dataclasses.dataclass
class Fp8Run:
    """One autocast call's FP8 settings: the options, the histories passed in
    (``None``: none), where discovered sites are collected (``None``: not asked),
    whether the state is in reach here, and the per-module site counters."""

    options: Fp8Options = dataclasses.field(default_factory=Fp8Options)
    state: dict | None = None
    sites: list | None = None
    reachable: bool = True
    counters: dict = dataclasses.field(default_factory=dict)

    def nested(self) -> "Fp8Run":
        """The same run inside a sub-program, where the state cannot be read."""
        return dataclasses.replace(self, reachable=False)

    def histories(self, path: tuple[str, ...]) -> tuple[Histories | None, str]:
        """The histories of the next site in module ``path``, and the reason to log."""
        if not self.options.delayed:
            return None, FP8_ROWWISE if self.options.rowwise else FP8_CURRENT
        if not self.reachable:
            return None, FP8_NESTED
        index = self.counters.get(path, 0)
        self.counters[path] = index + 1
        name = f"dot_general_{index}"
        if self.sites is not None:
            self.sites.append((path, name))
        node: Any = self.state
        for key in (*path, name):
            node = node.get(key) if isinstance(node, dict) else None
        if node is None:
            return None, FP8_NO_STATE
        return Histories(node["lhs"], node["rhs"], node["grad"]), FP8_DELAYED


def skip_reason(primitive: str, ins: list, eqn: Any, options: Fp8Options) -> str | None:
    """Why an allow-listed op in an FP8 region stays in the fallback dtype (None: it is FP8)."""
    if primitive != "dot_general":
        return NOT_A_DOT
    if not all(v.managed for v in ins):
        return "an operand the policy does not manage (already fp8, or integer)"
    return attention_or_size(eqn, ins, options.attention, options.min_size, "fp8")


def fp8_dot(site: Any, ins: list, run: Fp8Run, target: np.dtype, out_dtype: np.dtype,
            reduce_dtype: np.dtype | None = None, input_grad: np.dtype | None = None) -> tuple[Any, str]:
    """The site's ``dot_general`` in FP8: (result in ``out_dtype``, the reason to log).

    Operands are quantized from the dtype they are held in (a float32 master
    weight straight from float32); constants take the region's dtype first.
    A param's gradient is made in ``reduce_dtype`` (when given): the dtype a
    data-parallel step reduces it in (:mod:`precision.autocast.reductions`); the gradient
    of an operand that is not a param in ``input_grad`` (when given: a sum split across
    devices, :mod:`precision.autocast.split_sums`).
    """
    lhs, rhs = (v.as_dtype(target) if v.kind is Kind.NEUTRAL else v.array for v in ins)
    grads = gradient_dtypes(ins, (lhs, rhs), reduce_dtype, input_grad)
    histories, reason = run.histories(site.path)
    dims = site.eqn.params["dimension_numbers"]
    if run.options.rowwise:
        return rowwise_dot(lhs, rhs, dims, out_dtype, grads), reason
    return scaled_dot(lhs, rhs, dims, out_dtype, histories, grads), reason
