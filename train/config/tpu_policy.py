"""What a TPU computes natively: a policy in float16 (or FP8, on a TPU without FP8 matrix
units) is not, and says so in one line naming ``mixed_bf16``.

``--compile-for v5e`` refuses such a policy (:func:`train.inspections.compile_for.check_tpu_policy`);
a run on a TPU notes it and goes on (emulated). ``target``: a
:class:`train.inspections.targets.TpuTarget` (its ``name`` and ``fp8``), or None for any TPU.
"""

from __future__ import annotations

from typing import Any

import numpy as np

import precision
from train.config.schema import ExperimentConfig

__all__ = ["tpu_config_problem", "tpu_policy_problem"]

#: Policy dtypes a TPU's matrix units do not multiply, and what to use instead.
_NOT_ON_TPU = {"float16": "float16 is not native on a TPU (its matrix units multiply bfloat16; XLA would emulate "
                          "float16), and loss scaling is not needed for bfloat16: use precision.policy=mixed_bf16",
               "fp8": "none of these TPU generations multiplies FP8: use precision.policy=mixed_bf16"}


def tpu_config_problem(config: ExperimentConfig, target: Any = None) -> str:
    """``"precision.policy=mixed_f16 for v5e: ..."``: the config's policy (or first rule) that a
    TPU (``target``; None: any TPU, without FP8) cannot compute in, and why; "" if none."""
    named = [("precision.policy", config.precision.policy)]
    named += [(f"precision.rules[{i}]", rule[1]) for i, rule in enumerate(config.precision.rules or [])
              if isinstance(rule, (list, tuple)) and len(rule) == 2]
    for where, text in named:
        problem = tpu_policy_problem(text, target)
        if problem:
            return f"{where}={text} for {target.name if target is not None else 'a TPU'}: {problem}"
    return ""


def tpu_policy_problem(policy: Any, target: Any = None) -> str:
    """Why ``policy`` (a string or :class:`precision.Policy`) cannot compute on a TPU (float16,
    or FP8 where ``target`` has no FP8 matrix units; None: none has), in words; "" if it can."""
    try:
        policy = precision.get_policy(policy)
    except (ValueError, TypeError):
        return ""  # the config's own checks say what is wrong with it
    dtypes = {np.dtype(d).name for d in (policy.param_dtype, policy.compute_dtype, policy.output_dtype)}
    fp8 = target is not None and target.fp8
    found = "fp8" if policy.fp8 and not fp8 else "float16" if "float16" in dtypes else None
    return _NOT_ON_TPU[found] if found else ""
