"""The matrix-unit ops of a program compiled for a TPU, read from its optimized HLO text.

XLA's TPU compiler writes every matrix multiplication as a ``convolution`` (a
``dot_general`` becomes one with a window of size 1) and runs it on the chip's
matrix units (MXUs), fused with what feeds it and what it feeds. So where a GPU
program has library calls to read (:mod:`train.inspections.gpu_kernels`), a TPU
program has ``convolution`` and ``dot`` instructions, in fusions or alone: each
is one :class:`~train.inspections.gpu_kernels.Kernel` of kind ``tpu_matmul``
with its operand dtypes (those the MXU reads: a ``convert`` fused before it is
part of the op) and the module path of the op it came from. A Pallas kernel is a
``tpu_custom_call``: the fused attention autocast puts in a TPU program
(:mod:`precision.autocast.tpu_attention`) is one of kind ``tpu_flash_attention``
forward and two of ``tpu_flash_attention_backward`` (its ``dq`` and ``dk, dv``
kernels), with their query, key and value dtypes.

The arithmetic of a float32 matmul on a TPU (:func:`tpu_f32_algorithm`) is not a
GPU's: at XLA's default precision the MXU multiplies float32 operands rounded to
bfloat16 in one pass; ``HIGH`` takes three bfloat16 passes, ``HIGHEST`` six
(float32 accuracy).
"""

from __future__ import annotations

import re

from precision.autocast.scaled.int8_pallas import SCOPE as INT8_SCOPE, module_path as int8_module
from precision.autocast.tpu_flash import BACKWARD_SCOPE, FORWARD_SCOPE, module_path as attention_module
from train.inspections.gpu_kernels import Kernel, attribute, computations, module_of

__all__ = ["read_tpu_kernels", "tpu_f32_algorithm"]

_MATMUL_OPS = ("convolution", "dot")
_PRECISION_PASSES = {0: "bf16", 1: "bf16_3x", 2: "bf16_6x"}
_RANK = {"default": 0, "high": 1, "highest": 2}



def read_tpu_kernels(text: str) -> list[Kernel]:
    """Every matmul and convolution of an optimized TPU HLO module's text, and every Pallas
    flash attention kernel, once each (a loop body's once, however many times it runs), in
    program order."""
    kernels = []
    for comp in computations(text).values():  # fused computations too: a TPU matmul is one op wherever it sits
        for instr in comp["instrs"]:
            op_name = attribute(instr.rest, "op_name")
            if instr.op == "custom-call" and f"/{FORWARD_SCOPE}" in op_name:
                kind = "tpu_flash_attention_backward" if f"/{BACKWARD_SCOPE}/" in op_name else "tpu_flash_attention"
                types = [comp["types"].get(o, "") for o in instr.operands]  # splash's mask tables (ints) first
                operands = tuple(t for t in types if t.startswith(("bf", "f")))[:3]  # query, key, value
                kernels.append(Kernel(kind, operands, instr.dtype, attention_module(module_of(op_name)), op_name))
            if instr.op == "custom-call" and f"/{INT8_SCOPE}/" in op_name:  # quantizes in VMEM, then s8 x s8 -> s32
                kernels.append(Kernel("tpu_matmul", ("s8", "s8"), "s32", int8_module(module_of(op_name)), op_name))
            if instr.op not in _MATMUL_OPS:
                continue
            operands = tuple(comp["types"].get(o, "") for o in instr.operands[:2])
            kernels.append(Kernel("tpu_matmul", operands, instr.dtype, module_of(op_name), op_name,
                                  algorithm=tpu_f32_algorithm(operands, instr.rest)))
    return kernels


def tpu_f32_algorithm(operands: tuple[str, ...], rest: str) -> str:
    """The arithmetic of a matmul whose operands are both float32 on a TPU's MXU ("" for any
    other): ``bf16`` (one pass over operands rounded to bfloat16: XLA's default precision),
    ``bf16_3x`` (``HIGH``), ``bf16_6x`` (``HIGHEST``: float32 accuracy), or a named dot algorithm."""
    if set(operands) != {"f32"} or len(operands) != 2:
        return ""
    named = re.search(r"\balgorithm=dot_(\w+)", rest)
    if named:
        return named.group(1).lower()
    asked = re.search(r"operand_precision=\{([^}]*)\}", rest)
    names = re.findall(r"\w+", asked.group(1).lower()) if asked else []
    return _PRECISION_PASSES[max((_RANK.get(n, 0) for n in names), default=0)]
