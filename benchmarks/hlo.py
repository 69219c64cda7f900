"""Matmul and convolution FLOPs by dtype, read from HLO text.

Tells how much of a program's matrix arithmetic runs in half precision. Read
from the *lowered* program it is what the model asked for; read from the
*compiled* one it is what the backend runs: XLA's CPU backend rewrites
bfloat16/float16 dots to float32, a GPU keeps them in half on tensor cores.

Understands ``dot`` and ``convolution`` instructions (also inside fusions) and
the GPU library calls they become (cuBLAS gemm, cuDNN convolution custom-calls).
Each instruction is counted once: a loop body that runs N times counts once.
"""

from __future__ import annotations

import re
from typing import NamedTuple

from train.inspections.hlo_kernels import conv_flops, dot_flops

#: Every input type below 32 bits (int8 GEMMs count as reduced precision too).
HALF_TYPES = ("f16", "bf16", "f8e4m3fn", "f8e5m2", "f8e4m3", "f8e5m2fnuz", "f8e4m3fnuz", "s8")

_SHAPE = r"([a-z][a-z0-9]*)\[([0-9,]*)\]"
_INSTRUCTION = re.compile(
    r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(\(?[a-z][a-z0-9]*\[[0-9,]*\][^ ]*(?:,\s*[a-z][a-z0-9]*\[[0-9,]*\][^ ]*)*\)?)"
    r"\s+([\w\-]+)\((.*)$")
_PARAMETER = re.compile(r"%?([\w.\-]+):\s*" + _SHAPE)
_GEMM_TARGETS = ("gemm", "matmul")
_CONV_TARGETS = ("conv",)


class MatmulFlops(NamedTuple):
    """FLOPs of the dots and convolutions of one program, split by input dtype."""

    total: float
    half: float
    by_dtype: dict[str, float]

    @property
    def half_share(self) -> float:
        """Fraction of matmul/conv FLOPs whose inputs are half precision (nan if none)."""
        return self.half / self.total if self.total else float("nan")


def _shape(text: str) -> tuple[str, tuple[int, ...]] | None:
    match = re.search(_SHAPE, text)
    if match is None:
        return None
    dims = tuple(int(d) for d in match.group(2).split(",") if d)
    return match.group(1), dims


def _operand_names(args: str) -> list[str]:
    """The operand names of an instruction's argument list (up to its closing paren)."""
    names, depth, token = [], 0, ""
    for ch in args:
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            if depth == 0:  # the instruction's closing paren
                break
            depth -= 1
        if ch == "," and depth == 0:
            names.append(token)
            token = ""
        else:
            token += ch
    names.append(token)
    return [t.split()[-1].lstrip("%") for t in names if t.strip()]


def matmul_flops(hlo_text: str) -> MatmulFlops:
    """Sums the FLOPs of every dot/convolution in ``hlo_text`` by the dtype of its first input."""
    shapes: dict[str, tuple[str, tuple[int, ...]]] = {}
    pending = []
    for line in hlo_text.splitlines():
        if "->" in line and line.rstrip().endswith("{") and "(" in line:  # computation header: its parameters
            for name, dtype, dims in _PARAMETER.findall(line.split("->")[0]):
                shapes[name] = (dtype, tuple(int(d) for d in dims.split(",") if d))
            continue
        match = _INSTRUCTION.match(line)
        if match is None:
            continue
        name, out_text, opcode, rest = match.groups()
        out = _shape(out_text)  # a tuple's first element: cuBLAS/cuDNN calls return (result, workspace)
        if out is None:
            continue
        shapes[name] = out
        if opcode in ("dot", "convolution", "custom-call"):
            pending.append((opcode, out, rest))
    by_dtype: dict[str, float] = {}
    for opcode, (_, out), rest in pending:
        operands = [shapes.get(n) for n in _operand_names(rest)]
        if len(operands) < 2 or operands[0] is None or operands[1] is None:
            continue
        (dtype, lhs), (_, rhs) = operands[0], operands[1]
        if opcode == "dot":
            algorithm = re.search(r"algorithm=dot_(bf16|f16)_\1_(?:f32|\1)\b", rest)
            dtype = algorithm.group(1) if algorithm else dtype  # both operands rounded to half by the algorithm
            flops = dot_flops(out, lhs, rest)
        elif opcode == "convolution":
            flops = conv_flops(out, rhs, rest)
        else:
            target = re.search(r'custom_call_target="([^"]*)"', rest)
            target = target.group(1).lower() if target else ""
            if any(t in target for t in _GEMM_TARGETS):
                flops = dot_flops(out, lhs, rest)
            elif any(t in target for t in _CONV_TARGETS):
                flops = conv_flops(out, rhs, rest)
            else:
                continue
        by_dtype[dtype] = by_dtype.get(dtype, 0.0) + flops
    total = sum(by_dtype.values())
    half = sum(v for k, v in by_dtype.items() if k in HALF_TYPES)
    return MatmulFlops(total, half, by_dtype)
