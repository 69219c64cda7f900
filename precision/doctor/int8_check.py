"""What int8 does to each module's operands: the share of values rounded to zero and saturated.

An int8 product scales each row (column) by its largest magnitude over 127:
one outlier in a row takes the scale, and the row's ordinary values, far below
it, round to zero. The doctor runs the model (forward and, given a loss, the
backward) once more with every int8 product reporting its operands' shares
(:func:`precision.autocast.scaled.int8_quantize.record`), and names each module
whose operands lose more than :data:`THRESHOLD` of their nonzero values: a
problem whose fix, verified like the others, is a rule keeping that module in
the fallback dtype.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Callable

import jax
import jax.numpy as jnp

from precision.autocast.scaled.int8_quantize import RECORDING
from precision.doctor.analysis import Problem
from precision.rules import as_rules

__all__ = ["THRESHOLD", "uses_int8", "int8_shares", "int8_problems"]

#: A module whose int8 operands round more than this share of their nonzero values to zero is a problem.
THRESHOLD = 0.05


def uses_int8(policy: Any, rules: tuple) -> bool:
    """Whether the policy or a rule (a Rule, or a (pattern, spec) pair a change added) computes in int8."""
    return policy.int8 or any(rule.policy.int8 for rule in as_rules(list(rules)))


def int8_shares(forward: Callable, params: Any, loss_fn: Callable | None) -> dict[tuple[str, str], tuple]:
    """Per (module, pass): (largest zero share, its operand, largest saturated share) of its int8 operands,
    from one run of ``forward(params)`` (and the gradient of ``loss_fn`` of it, when given)."""
    sink: list = []
    token = RECORDING.set(sink)
    try:
        if loss_fn is None:
            out = jax.jit(forward)(params)
        else:
            out = jax.jit(jax.grad(lambda p: jnp.asarray(loss_fn(forward(p)), jnp.float32)))(params)
        jax.block_until_ready(out)
        jax.effects_barrier()
    finally:
        RECORDING.reset(token)
    worst: dict[tuple[str, str], list] = defaultdict(lambda: [0.0, "", 0.0])
    for where, pass_, operand, zero, saturated in sink:
        row = worst[(where, pass_)]
        if zero >= row[0]:
            row[0], row[1] = zero, operand
        row[2] = max(row[2], saturated)
    return {key: tuple(row) for key, row in worst.items()}


def int8_problems(forward: Callable, params: Any, loss_fn: Callable | None) -> tuple[Problem, ...]:
    """The modules whose int8 operands round more than :data:`THRESHOLD` of their values to zero."""
    problems = []
    for (where, pass_), (zero, operand, saturated) in int8_shares(forward, params, loss_fn).items():
        if zero > THRESHOLD:
            problems.append(Problem("int8", pass_, where, "", zero,
                                    f"{100 * zero:.1f}% of its {operand}'s nonzero values round to zero in int8 "
                                    f"(a row's outlier sets its scale); {100 * saturated:.2f}% at the int8 maximum"))
    return tuple(sorted(problems, key=lambda p: -p.share))
