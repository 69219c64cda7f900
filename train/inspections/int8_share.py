"""The int8 share of a compiled program's matmul FLOPs, and which targets multiply int8 or FP8.

Under ``mixed_int8`` what the compiled program proves is how much of its matrix
work reads int8 operands: on a TPU the matrix unit's ``convolution`` ops with
``s8`` operands and an ``s32`` result, on a GPU the GEMMs (cuBLASLt's or a
Triton GEMM fusion) with ``s8`` operands. The share is of the FLOPs of the
GEMMs and convolutions (a loop body's once per iteration), attention's fused
kernels aside (they stay bf16 by design); what stays out is named by module.

:func:`matrix_unit_problem` refuses, in one line, a policy whose 8-bit format
the target's matrix units do not multiply: FP8 on an A100 (sm_80), int8 on a
GPU before Turing.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, NamedTuple

import precision

__all__ = ["Int8Share", "int8_share", "matrix_unit_problem"]

_MATMUL_KINDS = ("gemm", "conv")


class Int8Share(NamedTuple):
    """A program's matmul FLOPs (GEMMs and convolutions, fused attention kernels aside) with int8 operands."""

    int8_flops: float
    total_flops: float
    int8_ops: int  # matmul ops with int8 operands (a loop body's counted once)
    total_ops: int
    outside: tuple[tuple[str, str, float], ...]  # (module, operand dtype, FLOPs) of the others, largest first

    @property
    def share(self) -> float:
        return self.int8_flops / self.total_flops if self.total_flops else 0.0

    def to_json(self) -> dict[str, Any]:
        return {"int8_share": self.share, "int8_flops": self.int8_flops, "matmul_flops": self.total_flops,
                "int8_ops": self.int8_ops, "matmul_ops": self.total_ops,
                "outside": [{"module": m, "dtype": d, "flops": f} for m, d, f in self.outside]}

    def lines(self, top: int = 6) -> list[str]:
        """The report's lines: the share, then the largest matmuls that are not int8, by module."""
        out = [f"int8 matmuls: {self.int8_ops} of {self.total_ops}; int8 share of matmul FLOPs (fused attention "
               f"aside): {100 * self.share:.1f}% of {self.total_flops / 1e12:.3f} TFLOP"]
        for module, dtype, flops in self.outside[:top]:
            out.append(f"  not int8: {module or '(outside any module)'} ({dtype}, "
                       f"{100 * flops / self.total_flops:.2f}% of the FLOPs)")
        if len(self.outside) > top:
            out.append(f"  ... and {len(self.outside) - top} more modules")
        return out


def int8_share(kernels: list) -> Int8Share:
    """The int8 share of the matmul FLOPs of a program's kernels
    (:class:`train.inspections.hlo_kernels.HloKernel`\\ s: GPU or TPU)."""
    matmuls = [k for k in kernels if k.kind in _MATMUL_KINDS and k.flops]
    int8 = [k for k in matmuls if k.dtype in ("s8", "u8")]
    outside: dict[tuple[str, str], float] = defaultdict(float)
    for k in matmuls:
        if k.dtype not in ("s8", "u8"):
            outside[(k.module, k.dtype)] += k.flops * k.launches
    rows = tuple(sorted(((m, d, f) for (m, d), f in outside.items()), key=lambda r: -r[2]))
    return Int8Share(sum(k.flops * k.launches for k in int8), sum(k.flops * k.launches for k in matmuls),
                     len(int8), len(matmuls), rows)


def matrix_unit_problem(config: Any, target: Any) -> str:
    """``"precision.policy=mixed_fp8 for a100: ..."``: the config's policy (or first rule) whose
    8-bit matmuls ``target``'s matrix units do not multiply, and what to use; "" if none."""
    named = [("precision.policy", config.precision.policy)]
    named += [(f"precision.rules[{i}]", rule[1]) for i, rule in enumerate(config.precision.rules or [])
              if isinstance(rule, (list, tuple)) and len(rule) == 2]
    for where, text in named:
        try:
            policy = precision.get_policy(text)
        except (ValueError, TypeError):
            continue  # the config's own checks say what is wrong with it
        if policy.fp8 and not getattr(target, "fp8", True):
            return (f"{where}={text} for {target.name}: the {target.device_kind} has no FP8 matrix units; use "
                    f"precision.policy=mixed_int8 (int8 at twice its bf16 rate) or mixed_bf16")
        if policy.int8 and not getattr(target, "int8", True):
            return (f"{where}={text} for {target.name}: the {target.device_kind} has no int8 matrix units; use "
                    f"precision.policy=mixed_bf16")
    return ""
