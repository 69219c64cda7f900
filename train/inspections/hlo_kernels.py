"""Every kernel an optimized GPU program launches, with its bytes and FLOPs, read from its HLO text.

:mod:`train.inspections.gpu_kernels` names the GEMM, attention and convolution kernels of a
compiled program; this module lists *all* of them, as XLA's GPU runtime would
launch them for one step: each fusion (an elementwise loop, a reduction, a
Triton GEMM...), each library call (cuBLAS, cuBLASLt, cuDNN attention and
convolution), each copy and collective, and the kernels of a loop's body once
per iteration (its known trip count). For each: the bytes it reads and writes
in device memory and its matrix FLOPs, from the shapes in the text.

Bytes are what the kernel must move at least: its operands and results, but a
fusion that only slices an operand (``dynamic-slice``, ``slice``, ``gather``, also
after elementwise ops) reads the slice, and one that updates a buffer in place (``dynamic-update-slice``,
``scatter``) reads and writes the update, not the buffer. No cache is assumed. A
collective's bytes are what each device sends over its links (ring algorithms: an all-reduce
twice what a reduce-scatter or an all-gather of the same array sends).
"""

from __future__ import annotations

import math
import re
from typing import Iterator, NamedTuple

from train.inspections.gpu_kernels import (INSTRUCTION as _INSTR, attribute, f32_algorithm, instruction_lines,
                                          module_of, operand_names)
from train.inspections.matmul_flops import conv_flops, dot_flops, ints as _ints
from train.parallel.communication import group_size, sent_fraction

__all__ = ["HloKernel", "read_hlo_kernels", "KINDS", "DTYPE_BYTES", "dot_flops", "conv_flops"]

#: Bytes per element of HLO's element types.
DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s4": 0.5, "u4": 0.5, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
               "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
               "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3": 1, "f8e4m3fnuz": 1, "f8e5m2fnuz": 1, "f8e3m4": 1,
               "f8e4m3b11fnuz": 1, "f4e2m1fn": 0.5, "f8e8m0fnu": 1, "token": 0}
#: Kernel kinds, as a profile of the device names them (``benchmarks.profile_step``): matrix
#: multiplications, cuDNN attention, convolutions, reductions, other fusions, copies, collectives.
KINDS = ("gemm", "attention", "conv", "reduction", "fusion", "copy", "collective")

#: Instructions that launch nothing: views, tuples, constants, control flow (their bodies do).
_NO_KERNEL = frozenset({"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all",
                        "partition-id", "replica-id", "opt-barrier", "add-dependency", "while", "conditional",
                        "call", "all-reduce-done", "all-gather-done", "collective-permute-done", "async-done",
                        "copy-done", "send-done", "recv-done", "domain", "iota"})
_COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute",
                "ragged-all-to-all", "collective-broadcast")
_GEMM_TARGETS = ("__cublas$gemm", "__cublas$lt$matmul", "__cublas$lt$matmul$f8")
_SLICING = frozenset({"dynamic-slice", "slice", "gather"})
#: Ops XLA computes per output element, so a slice after them computes (and reads) only the slice.
_ELEMENTWISE = frozenset({"add", "subtract", "multiply", "divide", "maximum", "minimum", "negate", "abs",
                          "convert", "bitcast", "broadcast", "reshape", "select", "compare", "exponential",
                          "log", "tanh", "logistic", "sqrt", "rsqrt", "power", "and", "or", "not", "clamp"})

_HEADER = re.compile(r"^(ENTRY\s+)?%?(?P<name>[\w.\-]+)\s*\((?P<params>.*)\)\s*->\s*.*\{\s*$")
_PARAM = re.compile(r"%?([\w.\-]+):\s*(\([^()]*\)|[a-z][a-z0-9]*\[[0-9,]*\](?:\{[^}]*\})?)")
_ARRAY = re.compile(r"([a-z][a-z0-9]*)\[([0-9,]*)\](\{[^}]*\})?")
#: A layout's memory space other than device memory: a TPU's VMEM ``S(1)``, its sync flags ``S(2)``, SMEM...
_ON_CHIP = re.compile(r"S\([1-9]\d*\)")
# A cuDNN attention's mask, as JAX writes its backend config (json.dumps: '"mask_type": "CAUSAL"') and as
# XLA prints it again once a GPU compiled it (compact: '"mask_type":"CAUSAL"'); with padding too.
_CAUSAL = re.compile(r'"mask_type"\s*:\s*"(?:PADDING_)?CAUSAL"')
#: Asynchronous moves between memory spaces (a TPU's prefetch of an operand, or of a slice of one, into
#: VMEM; an eviction back to HBM), and where in their result tuple the destination is.
_ASYNC_MOVES = {"copy-start": 0, "slice-start": -2}


class HloKernel(NamedTuple):
    """One kernel of a compiled GPU program, as launched in one step."""

    name: str  # the HLO instruction ("loop_add_fusion.3", "custom-call.12")
    kind: str  # one of KINDS
    launches: int  # per step: a loop body's kernels run once per iteration
    bytes: float  # read + written in device memory, per launch
    flops: float  # matrix FLOPs per launch (GEMMs, attention, convolutions); 0 for the rest
    dtype: str  # a GEMM's / attention's operand type ("bf16", "f32", "f8e4m3fn"); the result's otherwise
    module: str  # module path of the op it came from ("" if unknown)
    precision: str = ""  # a float32 GEMM: "highest" where it runs in full float32, else "" (TF32)
    causal: bool = False  # attention with a causal mask


class _Instr(NamedTuple):
    name: str
    type: str
    op: str
    operands: tuple[str, ...]
    rest: str


class _Comp(NamedTuple):
    types: dict[str, str]
    instrs: list[_Instr]
    root: list[str]  # the ROOT instruction's name (a list, filled while parsing)


_TRITON = "__gpu$xla.gpu.triton"
_ALIASED = re.compile(r"output_to_operand_aliasing=\{((?:\{[^{}]*\}: \(\d+, \{[^{}]*\}\)(?:, )?)*)\}")


def _bytes(type_text: str, drop_workspace: bool = False) -> float:
    """Bytes in device memory of an HLO type (an array or a tuple of them): an array whose layout
    puts it in another memory space (a TPU's VMEM, ``S(1)``) is no device-memory traffic;
    ``drop_workspace``: a library call's trailing ``u8``/``s8`` scratch buffer is not traffic either."""
    arrays = _ARRAY.findall(type_text)
    if drop_workspace and len(arrays) > 1 and arrays[-1][0] in ("u8", "s8"):
        arrays = arrays[:-1]
    return sum(_array_bytes(t, dims) for t, dims, layout in arrays if not _ON_CHIP.search(layout))


def _aliased_result_bytes(instr: "_Instr") -> float:
    """Bytes of a Pallas (Triton) kernel's results aliasing its operands (a buffer updated in place, the
    fused decode's cache): counted once, as read. A library call's (a GEMM into its output) is written whole."""
    aliased, results = _ALIASED.search(instr.rest), _ARRAY.findall(instr.type)
    indices = ({int(i) for i in re.findall(r"\{(\d+)\}:", aliased.group(1))} if len(results) > 1 else {0}) \
        if aliased else set()
    return sum(_array_bytes(t, d) for i, (t, d, layout) in enumerate(results) if i in indices and not _ON_CHIP.search(layout))


def _array_bytes(dtype: str, dims: str) -> float:
    return DTYPE_BYTES.get(dtype, 4) * math.prod(int(d) for d in dims.split(",") if d)


def _async_move_bytes(instr: "_Instr", operand_types: list[str]) -> float:
    """Device-memory bytes of an asynchronous copy or slice: its destination's size, read from
    its source and written to its destination, for each of the two in device memory (a TPU's
    prefetch into VMEM reads HBM once; its result tuple also names the source, not traffic)."""
    arrays = _ARRAY.findall(instr.type)
    if len(arrays) < 2 or not operand_types:
        return 0.0
    dtype, dims, layout = arrays[_ASYNC_MOVES[instr.op]]
    source = _ARRAY.findall(operand_types[0])
    ends = (not source or not _ON_CHIP.search(source[0][2])) + (not _ON_CHIP.search(layout))
    return _array_bytes(dtype, dims) * ends


def _dims(type_text: str) -> tuple[int, ...]:
    m = _ARRAY.search(type_text)
    return tuple(int(d) for d in m.group(2).split(",") if d) if m else ()


def _dtype(type_text: str) -> str:
    m = _ARRAY.search(type_text)
    return m.group(1) if m else ""


def _parse(text: str) -> tuple[dict[str, _Comp], str]:
    comps: dict[str, _Comp] = {}
    entry, current = "", None
    for line in instruction_lines(text):
        header = _HEADER.match(line)
        if header and not line.startswith(" "):
            current = _Comp(dict(_PARAM.findall(header.group("params"))), [], [])
            comps[header.group("name")] = current
            entry = header.group("name") if header.group(1) else entry
            continue
        m = _INSTR.match(line) if current is not None else None
        if m is None:
            continue
        instr = _Instr(m.group("name"), m.group("type"), m.group("op"), tuple(operand_names(m.group("rest"))),
                       m.group("rest"))
        current.types[instr.name] = instr.type
        current.instrs.append(instr)
        if line.lstrip().startswith("ROOT"):
            current.root.append(instr.name)
    return comps, entry


def _called(rest: str, key: str) -> list[str]:
    """The computations an instruction names under ``key`` (``calls=%f``, ``branch_computations={%a, %b}``)."""
    m = re.search(r"\b" + key + r"=(?:\{([^}]*)\}|%?([\w.\-]+))", rest)
    if not m:
        return []
    return re.findall(r"%?([\w.\-]+)", m.group(1)) if m.group(1) is not None else [m.group(2)]


def _trip_count(rest: str, comps: dict[str, "_Comp"]) -> int:
    """How many times a ``while`` runs its body: the ``known_trip_count`` XLA:GPU writes on it, else
    its condition's ``counter < N`` (XLA:TPU writes no count: a scan over layers compares its
    counter, which starts at 0, with a constant), else once."""
    m = re.search(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"(\d+)"', rest)
    if m:
        return int(m.group(1))
    condition = comps.get(next(iter(_called(rest, "condition")), ""))
    if condition is None or not condition.root:
        return 1
    by_name = {i.name: i for i in condition.instrs}
    root = by_name.get(condition.root[-1])
    if root is None or root.op != "compare" or "direction=LT" not in root.rest or len(root.operands) != 2:
        return 1
    counter, bound = (by_name.get(o) for o in root.operands)
    value = re.match(r"(\d+)\)", bound.rest) if bound is not None and bound.op == "constant" else None
    first = counter is not None and counter.op == "get-tuple-element" and re.search(r"\bindex=0\b", counter.rest)
    return int(value.group(1)) if value and first else 1


def read_hlo_kernels(text: str) -> list[HloKernel]:
    """The kernels of an optimized GPU HLO module's text (``compiled.as_text()``) in one step."""
    comps, entry = _parse(text)
    partitions = re.search(r"num_partitions=(\d+)", text.split("\n", 1)[0])
    return list(_walk(comps, entry, 1, set(), int(partitions.group(1)) if partitions else 1))


def _walk(comps: dict[str, _Comp], name: str, launches: int, stack: set, devices: int) -> Iterator[HloKernel]:
    if name not in comps or name in stack:
        return
    comp = comps[name]
    for instr in comp.instrs:
        if instr.op == "while":
            trips = launches * _trip_count(instr.rest, comps)
            for key in ("condition", "body"):
                for sub in _called(instr.rest, key):
                    yield from _walk(comps, sub, trips, stack | {name}, devices)
        elif instr.op == "conditional":  # the costliest branch
            branches = [list(_walk(comps, b, launches, stack | {name}, devices))
                        for b in _called(instr.rest, "branch_computations") + _called(instr.rest, "true_computation")
                        + _called(instr.rest, "false_computation")]
            yield from max(branches, key=lambda ks: sum(k.bytes + k.flops for k in ks), default=[])
        elif instr.op == "call" or (instr.op == "async-start" and "calls=" in instr.rest):
            for sub in _called(instr.rest, "to_apply") + _called(instr.rest, "calls"):
                yield from _walk(comps, sub, launches, stack | {name}, devices)
        elif instr.op not in _NO_KERNEL and not instr.op.endswith("-done"):
            yield _kernel(instr, comp, comps, launches, devices)


def _kernel(instr: _Instr, comp: _Comp, comps: dict[str, _Comp], launches: int, devices: int = 1) -> HloKernel:
    op_name = attribute(instr.rest, "op_name")
    module = module_of(op_name)
    operand_types = [comp.types.get(o, "") for o in instr.operands]
    moved = sum(_bytes(t) for t in operand_types) + _bytes(instr.type, drop_workspace=True)
    base = dict(name=instr.name, launches=launches, module=module)
    if instr.op == "custom-call":
        target = attribute(instr.rest, "custom_call_target")
        moved -= _aliased_result_bytes(instr) if target == _TRITON else 0.0
        if target in _GEMM_TARGETS:
            precision = _precision("cublas", operand_types, instr.rest, '"HIGHEST"' in instr.rest)
            return HloKernel(kind="gemm", bytes=moved, flops=_gemm_flops(instr.type, operand_types, instr.rest),
                             dtype=_dtype(operand_types[0]), precision=precision, **base)
        if target.startswith("__cudnn$fmha"):
            return HloKernel(kind="attention", bytes=moved, flops=_attention_flops(target, operand_types, instr.rest),
                             dtype=_dtype(operand_types[0]), causal=bool(_CAUSAL.search(instr.rest)), **base)
        if target.startswith("__cudnn$conv"):
            return HloKernel(kind="conv", bytes=moved, flops=_conv_flops(instr.type, operand_types, instr.rest),
                             dtype=_dtype(operand_types[0]), **base)
        return HloKernel(kind="fusion", bytes=moved, flops=0.0, dtype=_dtype(instr.type), **base)
    if instr.op == "fusion":
        return _fusion(instr, operand_types, comps, base)
    if any(instr.op.startswith(c) for c in _COLLECTIVES):
        return HloKernel(kind="collective", bytes=_sent(instr, devices), flops=0.0, dtype=_dtype(instr.type), **base)
    if instr.op in _ASYNC_MOVES:
        return HloKernel(kind="copy", bytes=_async_move_bytes(instr, operand_types), flops=0.0,
                         dtype=_dtype(instr.type), **base)
    if instr.op in ("dot", "convolution"):  # left unfused: XLA's own emitter
        flops = _gemm_flops(instr.type, operand_types, instr.rest) if instr.op == "dot" else \
            _conv_flops(instr.type, operand_types, instr.rest)
        return HloKernel(kind="gemm" if instr.op == "dot" else "conv", bytes=moved, flops=flops,
                         dtype=_dtype(operand_types[0]), **base)
    kind = "copy" if instr.op in ("copy", "transpose") else (
        "reduction" if instr.op.startswith("reduce") else "fusion")
    return HloKernel(kind=kind, bytes=moved, flops=0.0, dtype=_dtype(instr.type), **base)


def _sent(instr: _Instr, devices: int) -> float:
    """Bytes a collective sends from each device over its links (ring algorithms: an all-reduce
    twice what a reduce-scatter or an all-gather of the same array sends); ``devices``: the
    program's, for a collective naming no groups."""
    arrays = [_bytes(f"{t}[{d}]") for t, d, _ in _ARRAY.findall(instr.type)]
    kind = next(c for c in _COLLECTIVES if instr.op.startswith(c))
    if instr.op.endswith("-start") and kind in ("all-gather", "reduce-scatter") and len(arrays) == 2:
        arrays = [max(arrays)]  # (operand, result): the whole array
    group = group_size(instr.rest, devices)
    whole = sum(arrays) * (group if kind == "reduce-scatter" and not instr.op.endswith("-start") else 1)
    return whole * sent_fraction(kind, group)


def _fusion(instr: _Instr, operand_types: list[str], comps: dict[str, _Comp], base: dict) -> HloKernel:
    called = _called(instr.rest, "calls")
    inner = comps.get(called[0]) if called else None
    kind_m = re.search(r'"kind"\s*:\s*"([^"]+)"', instr.rest)
    fusion_kind = kind_m.group(1) if kind_m else ""
    if inner is None:
        return HloKernel(kind="fusion", bytes=sum(_bytes(t) for t in operand_types) + _bytes(instr.type),
                         flops=0.0, dtype=_dtype(instr.type), **base)
    read = _fusion_reads(inner, operand_types)
    written, in_place = _fusion_writes(inner, instr.type)
    read -= in_place
    dots = [i for i in _all_instrs(inner, comps) if i[0].op in ("dot", "convolution")]
    if dots:
        flops = sum(_gemm_flops(d.type, [c.types.get(o, "") for o in d.operands], d.rest) if d.op == "dot" else
                    _conv_flops(d.type, [c.types.get(o, "") for o in d.operands], d.rest) for d, c in dots)
        first, c = dots[0]
        operands = [c.types.get(o, "") for o in first.operands[:2]]
        triton = fusion_kind in ("__triton_gemm", "__triton_nested_gemm_fusion")
        precision = _precision("triton_gemm", operands, first.rest, "highest" in first.rest) if triton else \
            ("highest" if "highest" in first.rest else "")
        return HloKernel(kind="gemm" if first.op == "dot" else "conv", bytes=read + written, flops=flops,
                         dtype=_dtype(operands[0] if operands else ""), precision=precision, **base)
    ops = {i.op for i, _ in _all_instrs(inner, comps)}
    kind = "reduction" if (fusion_kind == "kInput" and "reduce" in " ".join(ops)) or "reduce" in instr.name else \
        "copy" if ops <= {"parameter", "copy", "transpose", "bitcast"} else "fusion"
    return HloKernel(kind=kind, bytes=read + written, flops=0.0, dtype=_dtype(instr.type), **base)


def _precision(kind: str, operand_types: list[str], rest: str, asked_highest: bool) -> str:
    """``"highest"`` for a GEMM that runs in full float32 (asked for HIGHEST, or HIGH in a Triton
    GEMM, or the float32 dot algorithm: :func:`~train.inspections.gpu_kernels.f32_algorithm`), else ""."""
    dtypes = tuple(_dtype(t) for t in operand_types[:2])
    return "highest" if asked_highest or f32_algorithm(kind, dtypes, rest) == "f32" else ""


def _all_instrs(comp: _Comp, comps: dict[str, _Comp], seen: set | None = None) -> Iterator[tuple[_Instr, _Comp]]:
    seen = set() if seen is None else seen
    for instr in comp.instrs:
        yield instr, comp
        for key in ("calls", "to_apply"):
            for sub in _called(instr.rest, key):
                if sub in comps and sub not in seen and instr.op in ("fusion", "call"):
                    seen.add(sub)
                    yield from _all_instrs(comps[sub], comps, seen)


def _fusion_reads(inner: _Comp, operand_types: list[str]) -> float:
    """Bytes a fusion reads: each parameter whole, or only the elements its slices take
    (also through elementwise ops in between: XLA computes ``gather(logits + bias)`` for the
    gathered elements only)."""
    params = {i.name: int(re.match(r"(\d+)", i.rest).group(1)) for i in inner.instrs if i.op == "parameter"}
    users: dict[str, list[_Instr]] = {}
    for instr in inner.instrs:
        for o in instr.operands:
            users.setdefault(o, []).append(instr)
    total = 0.0
    for name, index in params.items():
        full = _bytes(operand_types[index]) if index < len(operand_types) else _bytes(inner.types.get(name, ""))
        taken = _elements_taken(name, users, set())
        size = _bytes(inner.types.get(name, "")) / max(math.prod(_dims(inner.types.get(name, ""))), 1)
        total += full if taken is None else min(full, taken * size)
    return total


def _elements_taken(name: str, users: dict[str, list[_Instr]], seen: set) -> float | None:
    """Elements of ``name`` that reach memory reads: the sum of the slices every use ends in
    (through elementwise ops), or None where some use reads it whole."""
    uses = users.get(name, [])
    if not uses:
        return None
    taken = 0.0
    for use in uses:
        if use.op in _SLICING and use.operands[0] == name:
            taken += math.prod(_dims(use.type))
        elif use.op in _ELEMENTWISE and use.name not in seen:
            seen.add(use.name)
            more = _elements_taken(use.name, users, seen)
            if more is None:
                return None
            taken += more
        else:
            return None
    return taken


def _fusion_writes(inner: _Comp, result_type: str) -> tuple[float, float]:
    """Bytes a fusion writes, and the bytes of buffers it updates in place (not read either)."""
    by_name = {i.name: i for i in inner.instrs}
    root = by_name.get(inner.root[-1]) if inner.root else (inner.instrs[-1] if inner.instrs else None)
    outputs = [] if root is None else [root]
    if root is not None and root.op == "tuple":
        outputs = [by_name[o] for o in root.operands if o in by_name]
    written, in_place = 0.0, 0.0
    for out in outputs:
        if out.op in ("dynamic-update-slice", "scatter") and len(out.operands) >= 2:
            update = out.operands[1] if out.op == "dynamic-update-slice" else out.operands[-1]
            update_bytes = _bytes(inner.types.get(update, ""))
            written += update_bytes
            buffer = by_name.get(out.operands[0])
            if buffer is not None and buffer.op == "parameter":
                in_place += _bytes(buffer.type) - (update_bytes if out.op == "scatter" else 0.0)
        else:
            written += _bytes(out.type)
    if not outputs:
        written = _bytes(result_type)
    return written, max(in_place, 0.0)


def _gemm_flops(result: str, operands: list[str], rest: str) -> float:
    return dot_flops(_dims(result), _dims(operands[0]) if operands else (), rest)


def _conv_flops(result: str, operands: list[str], rest: str) -> float:
    return conv_flops(_dims(result), _dims(operands[1]), rest, _dims(operands[0])) if len(operands) >= 2 else 0.0


def _attention_flops(target: str, operands: list[str], rest: str) -> float:
    """The two (forward) or five (backward, with the recomputed scores) products of
    ``softmax(q k^T) v`` over the intermediate ``[batch, heads, q, k]`` scores."""
    m = re.search(r'"intermediate_tensor_shape"\s*:\s*\{[^{}]*?"dimensions"\s*:\s*\[([^\]]*)\]', rest)
    if not m or not operands:
        return 0.0
    scores = math.prod(_ints(m.group(1)))
    head_dim = _dims(operands[0])[-1] if _dims(operands[0]) else 0
    products = 5 if "Backward" in target else 2
    return 2.0 * products * scores * head_dim
