"""The kernels of a program compiled for a GPU, read from its optimized HLO text.

What a policy promises on a GPU is decided by XLA's GPU compiler, so it is read
from the program that compiler produced (``jax.jit(f).lower(...).compile()
.as_text()``, for a real GPU or a compile-only target): which GEMMs run where
(cuBLAS, cuBLASLt, cuBLASLt's FP8 GEMM, a Triton GEMM fusion, or an XLA dot
left alone) with their operand dtypes, cuDNN's fused attention forward and
backward, cuDNN's convolutions, each with the module path of the op it came
from. A GEMM's operand dtypes are those its matrix unit reads: the ``dot``'s
operands inside a Triton fusion (a ``convert`` the fusion applies first is part
of the kernel), the custom call's operands for a library call.

A GEMM whose operands are both float32 also says the arithmetic it runs
(:func:`f32_algorithm`): TF32 at XLA's default precision, true float32 where
the program asked for it (``matmul=highest`` in a policy, docs/matmul-precision.md).

Each instruction is counted once: a loop body (a scanned layer) counts once
however many times it runs.
"""

from __future__ import annotations

import re
from typing import Iterator, NamedTuple
from urllib.parse import unquote

from precision.autocast.regions import MODULE_PREFIX, REDUCE_SCOPE_PREFIX, TAG_PREFIX

__all__ = ["Kernel", "read_kernels", "GEMM_KINDS", "module_of", "region_of", "fp8_accumulation", "f32_algorithm",
           "operand_names", "attribute", "computations", "instruction_lines"]

#: Kernel kinds that are matrix multiplications.
GEMM_KINDS = ("cublas", "cublaslt", "cublaslt_fp8", "triton_gemm", "xla_dot", "tpu_matmul")
#: Library calls by custom-call target (exact, or prefix for cuDNN's families).
_LIBRARY = {"__cublas$gemm": "cublas", "__cublas$lt$matmul": "cublaslt", "__cublas$lt$matmul$f8": "cublaslt_fp8"}
_TRITON_GEMM = ("__triton_gemm", "__triton_nested_gemm_fusion", "__cublas$lt$matmul")  # fusion kinds holding a GEMM
FP8_TYPES = frozenset({"f8e4m3fn", "f8e5m2", "f8e4m3", "f8e4m3fnuz", "f8e5m2fnuz", "f8e3m4", "f8e4m3b11fnuz"})
HALF_TYPES = frozenset({"f16", "bf16"}) | FP8_TYPES

_HEADER = re.compile(r"^(?:ENTRY\s+)?%?(?P<name>[\w.\-]+)\s*\((?P<params>.*)\)\s*->\s*.*\{\s*$")
_PARAM = re.compile(r"%?([\w.\-]+):\s*\(?([a-z][a-z0-9]*)\[")
#: One instruction of an HLO module's text: name, result type (a tuple's may hold ``/*index=5*/``), op, rest.
INSTRUCTION = _INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<type>\((?:[^=]|/\*index=\d+\*/)*?\)|[a-z][a-z0-9]*\[[^\]]*\]\S*)\s+"
                    r"(?P<op>[\w\-]+)\((?P<rest>.*)$")
_DTYPE = re.compile(r"([a-z][a-z0-9]*)\[")
#: Frames JAX writes into op names without parentheses (control flow, remat), not module scopes.
_JAX_FRAME = re.compile(r"cond|branch_\d+_fun|while|body|checkpoint|remat|rematted_computation|closed_call|shard_map")


class Kernel(NamedTuple):
    """One kernel of a compiled GPU program."""

    kind: str  # cublas, cublaslt, cublaslt_fp8, triton_gemm, xla_dot, cudnn_attention, cudnn_attention_backward,
    #            cudnn_conv; tpu_matmul (a TPU's matrix units), tpu_flash_attention(_backward) (Pallas kernels: both
    #            train.inspections.tpu_kernels)
    operands: tuple[str, ...]  # HLO element types of the operands it computes on (a GEMM: lhs, rhs)
    result: str  # HLO element type of its (first) result
    module: str  # module path of the op it came from ("" if unknown)
    op_name: str  # JAX's name for that op
    accumulation: str = ""  # an FP8 GEMM: "fast" (reduced precision) or "float32" (see fp8_accumulation)
    algorithm: str = ""  # a float32 GEMM: "tf32", "f32", "bf16_3x"... (see f32_algorithm)

    @property
    def region(self) -> str:
        """The compute region it sits in (``float32`` for a rule's island; see :func:`region_of`)."""
        return region_of(self.op_name)

    @property
    def gemm(self) -> bool:
        return self.kind in GEMM_KINDS

    @property
    def fp8(self) -> bool:
        """A GEMM with FP8 operands (cuBLASLt's FP8 call or a Triton FP8 GEMM)."""
        return self.gemm and any(t in FP8_TYPES for t in self.operands)

    @property
    def has_f32_operand(self) -> bool:
        return "f32" in self.operands or "f64" in self.operands


class _Instr(NamedTuple):
    name: str
    dtype: str
    op: str
    operands: tuple[str, ...]
    rest: str


def instruction_lines(text: str) -> list[str]:
    """An HLO module's text a line per instruction: a Pallas kernel's ``kernel_metadata``
    attribute (splash attention's block sizes) holds line breaks, which are joined here."""
    return _CONTINUED.sub("", text).splitlines()


_CONTINUED = re.compile(r'\n(?="xprof_metadata"|\}\})')


def computations(text: str) -> dict[str, dict]:
    """Computation name -> {"types": name -> element type, "instrs": [_Instr]}."""
    comps: dict[str, dict] = {}
    current = None
    for line in instruction_lines(text):
        header = _HEADER.match(line)
        if header and not line.startswith(" "):
            current = {"types": dict(_PARAM.findall(header.group("params"))), "instrs": []}
            comps[header.group("name")] = current
            continue
        if current is None:
            continue
        m = _INSTR.match(line)
        if m is None:
            continue
        dtype = _DTYPE.search(m.group("type"))
        instr = _Instr(m.group("name"), dtype.group(1) if dtype else "", m.group("op"),
                       tuple(operand_names(m.group("rest"))), m.group("rest"))
        current["types"][instr.name] = instr.dtype
        current["instrs"].append(instr)
    return comps


def operand_names(rest: str) -> list[str]:
    """The operand names of an instruction (its text up to the closing paren of its operand list)."""
    depth, end = 0, len(rest)
    for i, ch in enumerate(rest):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            if depth == 0:
                end = i
                break
            depth -= 1
    return re.findall(r"%([\w.\-]+)", rest[:end])


def module_of(op_name: str) -> str:
    """The module path in an op's name: after its last ``precision.module=`` tag, else
    Flax's scopes, without JAX's transformation frames, region tags and the op itself."""
    tail = op_name.rsplit(MODULE_PREFIX, 1)[-1].split("/")[:-1]
    return "/".join(unquote(p) for p in tail if p and not set(p) & set("(=:") and not _JAX_FRAME.fullmatch(p)
                    and not p.startswith(REDUCE_SCOPE_PREFIX))


def region_of(op_name: str) -> str:
    """The dtype of the innermost compute region (``precision.compute_in``, a rule) an
    op sits in: ``float32``, ``bfloat16``... (``""``: none)."""
    tags = re.findall(re.escape(TAG_PREFIX) + r"(?:fp8\+|int8\+)?([a-z0-9]+)", op_name)
    return tags[-1] if tags else ""


def attribute(rest: str, key: str) -> str:
    """The value of an instruction's ``key="..."`` attribute (``op_name``, ``custom_call_target``), or ""."""
    m = re.search(key + r'="([^"]*)"', rest)
    return m.group(1) if m else ""


def _called(rest: str) -> list[str]:
    return re.findall(r"(?:calls|to_apply|body|condition|branch_computations)=\{?%?([\w.\-]+)", rest)


def _dots(comps: dict, name: str, seen: set) -> Iterator[tuple[_Instr, dict]]:
    """The dot instructions of a computation and the computations it calls."""
    if name in seen or name not in comps:
        return
    seen.add(name)
    comp = comps[name]
    for instr in comp["instrs"]:
        if instr.op == "dot":
            yield instr, comp
        for sub in _called(instr.rest):
            yield from _dots(comps, sub, seen)


def read_kernels(text: str) -> list[Kernel]:
    """The GEMM, attention and convolution kernels of an optimized GPU HLO module's text."""
    comps = computations(text)
    fused = set()  # computations a fusion calls: read through their fusion, not on their own
    for comp in comps.values():
        for instr in comp["instrs"]:
            if instr.op == "fusion":
                fused.update(_called(instr.rest))
    kernels = []
    for name, comp in comps.items():
        if name in fused:
            continue
        for instr in comp["instrs"]:
            kernels.extend(_kernels_of(instr, comp, comps))
    return kernels


def _kernels_of(instr: _Instr, comp: dict, comps: dict) -> list[Kernel]:
    op_name = attribute(instr.rest, "op_name")
    types = comp["types"]
    if instr.op == "custom-call":
        target = attribute(instr.rest, "custom_call_target")
        operands = tuple(types.get(o, "") for o in instr.operands)
        if target in _LIBRARY:
            kind = _LIBRARY[target]
            return [Kernel(kind, operands[:2], instr.dtype, module_of(op_name), op_name,
                           fp8_accumulation(kind, operands[:2], instr.rest),
                           f32_algorithm(kind, operands[:2], instr.rest))]
        if target.startswith("__cudnn$fmha"):
            kind = "cudnn_attention_backward" if "Backward" in target else "cudnn_attention"
            return [Kernel(kind, operands[:3], instr.dtype, module_of(op_name), op_name)]
        if target.startswith("__cudnn$conv"):
            return [Kernel("cudnn_conv", operands[:2], instr.dtype, module_of(op_name), op_name)]
        return []
    if instr.op == "fusion":
        kind = _fusion_kind(instr.rest)
        found = []
        for dot, inner in _dots(comps, _called(instr.rest)[0] if _called(instr.rest) else "", set()):
            operands = tuple(inner["types"].get(o, "") for o in dot.operands[:2])
            gemm = "triton_gemm" if kind in _TRITON_GEMM else "xla_dot"
            found.append(Kernel(gemm, operands, dot.dtype, module_of(attribute(dot.rest, "op_name") or op_name),
                                attribute(dot.rest, "op_name") or op_name, fp8_accumulation(gemm, operands, dot.rest),
                                f32_algorithm(gemm, operands, dot.rest)))
        return found
    if instr.op == "dot":
        operands = tuple(types.get(o, "") for o in instr.operands[:2])
        return [Kernel("xla_dot", operands, instr.dtype, module_of(op_name), op_name,
                       algorithm=f32_algorithm("xla_dot", operands, instr.rest))]
    return []


def fp8_accumulation(kind: str, operands: tuple[str, ...], rest: str) -> str:
    """How an FP8 GEMM accumulates ("" for any other kernel), as XLA's GPU runtime decides:

    - cuBLASLt's FP8 call runs in cuBLASLt's fast (reduced-precision) mode when its
      dot algorithm is ``ALG_DOT_ANY_F8_ANY_F8_F32_FAST_ACCUM``, or when it names
      none and every operand precision is ``DEFAULT``; in float32 otherwise
      (``ALG_DOT_ANY_F8_ANY_F8_F32``, or ``HIGH``/``HIGHEST``);
    - a Triton GEMM with an f8 operand never promotes its accumulator: fast, whatever
      the precision asked.
    """
    if not any(t in FP8_TYPES for t in operands):
        return ""
    if kind != "cublaslt_fp8":
        return "fast" if kind == "triton_gemm" else ""
    config = re.search(r'"precision_config"\s*:\s*\{([^}]*)\}', rest)
    text = config.group(1) if config else ""
    algorithm = re.search(r'"algorithm"\s*:\s*"(\w+)"', text)
    if algorithm and algorithm.group(1) not in ("ALG_UNSET", ""):
        return "fast" if algorithm.group(1).endswith("_FAST_ACCUM") else "float32"
    precisions = re.findall(r'"(DEFAULT|HIGH|HIGHEST)"', text)
    return "float32" if any(p != "DEFAULT" for p in precisions) else "fast"


#: XLA's named dot algorithms (``algorithm=dot_bf16_bf16_f32_x3``) as the arithmetic they run.
_ALGORITHMS = {"tf32_tf32_f32": "tf32", "tf32_tf32_f32_x3": "tf32_3x", "f32_f32_f32": "f32", "bf16_bf16_f32": "bf16",
               "bf16_bf16_f32_x3": "bf16_3x", "bf16_bf16_f32_x6": "bf16_6x", "bf16_bf16_f32_x9": "bf16_9x"}
_RANK = {"default": 0, "high": 1, "highest": 2}


def f32_algorithm(kind: str, operands: tuple[str, ...], rest: str) -> str:
    """The arithmetic of a GEMM whose operands are both float32 ("" for any other kernel)
    on a GPU with TF32 (Ampere or later), as XLA's GPU compiler picks it:

    - a named dot algorithm: its own (``tf32``, ``f32``, ``bf16_3x``...);
    - XLA's own dot emitter (``xla_dot``): plain float32 whatever the precision;
    - precision ``HIGHEST``: ``f32``; ``HIGH``: ``f32`` in a Triton GEMM (its PTX
      has no TF32 instruction), ``tf32`` in cuBLAS (XLA allows TF32 up to HIGH);
      ``DEFAULT`` (none asked): ``tf32``.
    """
    if kind not in GEMM_KINDS or set(operands) != {"f32"} or len(operands) != 2:
        return ""
    named = re.search(r"\balgorithm=dot_(\w+)", rest) or re.search(r'"algorithm"\s*:\s*"ALG_DOT_(\w+)"', rest)
    if named:
        return _ALGORITHMS.get(named.group(1).lower(), named.group(1).lower())
    if kind == "xla_dot":
        return "f32"
    asked = re.search(r"operand_precision=\{([^}]*)\}", rest) or re.search(r'"operand_precision"\s*:\s*\[([^\]]*)\]', rest)
    names = re.findall(r"\w+", asked.group(1).lower()) if asked else []
    top = max((_RANK.get(n, 0) for n in names), default=0)
    if top == 2 or (top == 1 and kind == "triton_gemm"):
        return "f32"
    return "tf32"


def _fusion_kind(rest: str) -> str:
    m = re.search(r'"kind"\s*:\s*"([^"]+)"', rest)
    return m.group(1) if m else ""
