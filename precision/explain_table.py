"""The text of :class:`precision.explain.Explanation`'s table: FLOP shares, sizes, columns."""

from __future__ import annotations

import collections
import re
from typing import Any, Callable, NamedTuple

import numpy as np

from precision.autocast.attention_fusion import ATTENTION
from precision.autocast.norm_fusion import AS_WRITTEN, CLOSED_FORM, NORM
from precision.autocast.program import MATMUL_PRIMITIVES

__all__ = ["share_text", "columns", "fp8_rows", "coverage_text", "attention_reports", "attention_lines", "NOT_FUSED",
           "norm_reports", "norm_lines", "Island",
           "islands", "f32_precision", "flops_by_precision", "precision_column", "precision_line", "half_flops",
           "short_dtype"]

_F32 = np.dtype(np.float32)
#: Log records reporting a rewrite (an attention fused, a norm's backward), not an op's dtype.
_REWRITES = (ATTENTION, NORM)
#: How an attention left as it is is reported (then why).
NOT_FUSED = "not fused"
_FUSED = "fused attention"


def share_text(what: str, flops: tuple[float, float]) -> str:
    """``"forward 96.2% of 4.46 GFLOP"``: the share of ``flops = (part, total)``."""
    half, total = flops
    if not total:
        return f"{what}: no matmul/conv"
    return f"{what} {100 * half / total:.1f}% of {_human(total)}"


def half_flops(ops: Any) -> tuple[float, float]:
    """(FLOPs with half-precision operands, all FLOPs) of matmuls/convolutions (:class:`MatmulOp`)."""
    return sum(m.flops for m in ops if m.half), sum(m.flops for m in ops)


def short_dtype(dtype: str) -> str:
    """A dtype's name as the table prints it: ``f32``, ``bf16``, ``e4m3``..."""
    return {"float32": "f32", "bfloat16": "bf16", "float16": "f16", "float64": "f64", "float8_e4m3fn": "e4m3",
            "float8_e5m2": "e5m2", "int8": "int8"}.get(dtype, dtype)


def _human(flops: float) -> str:
    for unit, scale in (("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6), ("kFLOP", 1e3)):
        if flops >= scale:
            return f"{flops / scale:.3g} {unit}"
    return f"{flops:.0f} FLOP"


def columns(rows: list[tuple[str, ...]]) -> list[str]:
    """Rows of cells as left-aligned text columns."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]


def fp8_rows(modules: Any, name: str = "fp8") -> list[tuple[str, ...]]:
    """The FP8 (``name="int8"``: int8) table's rows: per module its 8-bit, 16-bit and float32
    shares and why a matmul is not 8-bit."""
    rows = [("module", "params", "matmul/conv", name, "16-bit", "f32", f"{name} recipe", f"not {name} because")]
    pct = lambda part, m: "" if not m.total_flops else f"{100 * part / m.total_flops:.0f}%"  # noqa: E731
    for m in modules:
        why = m.not_fp8_reason or m.f32_reason
        eight = m.int8_flops if name == "int8" else m.fp8_flops
        rows.append((m.path or "(top)", ",".join(m.param_dtypes), ",".join(m.matmul_dtypes), pct(eight, m),
                     pct(m.half_flops - eight, m), pct(m.total_flops - m.half_flops, m), m.fp8_recipe,
                     why if m.total_flops > eight else ""))
    return rows


def f32_precision(ops: Any) -> str:
    """The precisions of the float32 matmuls among ``ops`` (:class:`MatmulOp`), ``"highest"`` or
    ``"highest,default"``; ``""`` where all are at XLA's default (or there are none)."""
    names = dict.fromkeys(m.precision for m in ops if m.dtype == _F32)
    return ",".join(names) if any(name != "default" for name in names) else ""


def flops_by_precision(ops: Any) -> tuple[tuple[str, float], ...]:
    """Float32 matmul/conv FLOPs of ``ops`` (:class:`MatmulOp`) per precision (``default``, ``highest``...)."""
    flops: dict[str, float] = collections.defaultdict(float)
    for m in ops:
        if m.dtype == _F32:
            flops[m.precision] += m.flops
    return tuple(flops.items())


def precision_column(rows: list[tuple[str, ...]], modules: Any) -> list[tuple[str, ...]]:
    """The table's rows with a column for the precision of each module's float32 matmuls,
    where some module asked for one other than XLA's default (else the rows unchanged)."""
    if not any(m.f32_precision for m in modules):
        return rows
    return [rows[0] + ("f32 matmul precision",)] + [row + (m.f32_precision,) for row, m in zip(rows[1:], modules)]


def precision_line(flops: dict[str, float]) -> list[str]:
    """``float32 matmul/conv FLOPs by precision: highest 75.0%, default 25.0% of 1.2 MFLOP``, where
    some are at a precision other than XLA's default (else no line)."""
    total = sum(flops.values())
    if not total or set(flops) <= {"default"}:
        return []
    shares = ", ".join(f"{name} {100 * part / total:.1f}%" for name, part in
                       sorted(flops.items(), key=lambda kv: -kv[1]))
    tf32 = " (default: TF32 on GPUs that have it)" if "default" in flops else ""
    return [f"float32 matmul/conv FLOPs by precision: {shares} of {_human(total)}{tf32}"]


def coverage_text(share: float, reasons: list[str], name: str = "fp8") -> str:
    """The FP8 (``name="int8"``: int8) share of matmul FLOPs in words, with the reasons
    (sizes dropped, each once) the rest is not 8-bit."""
    if share != share:  # nan: no matmul at all
        return f"{name} covers no matmul FLOPs (the model has no matmul or convolution)"
    why = list(dict.fromkeys(reason.split(" (")[0] for reason in reasons))
    text = f"{name} covers {100 * share:.0f}% of matmul FLOPs"
    if share >= 1.0 or not why:
        return text
    if share == 0:
        text = f"{text} (all {why[0]})" if len(why) == 1 else f"{text} ({'; '.join(why)})"
        return text + _min_size_hint(reasons)
    return f"{text} (the rest: {'; '.join(why)})"


def _min_size_hint(reasons: list[str]) -> str:
    """For a run with no FP8 matmul: the ``min_size`` that would take the largest matmuls
    (the largest of their smallest sizes, read from the reasons' ``M x K x N``)."""
    sizes = [min(int(n) for n in m.groups()) for r in reasons
             if (m := re.search(r"M x K x N = (\d+)x(\d+)x(\d+)", r))]
    if not sizes:
        return ""
    return f"; min_size={max(sizes)} would take the largest matmuls"


def attention_reports(log: Any, path_of: Callable) -> tuple[tuple[str, str], ...]:
    """(module, what) for each softmax attention autocast met: fused and how, or why not
    (from its log; a module's attention traced again for the backward pass counted once)."""
    seen: dict[tuple[str, str], None] = {}
    for r in log:
        if r.primitive == "attention" or r.reason.startswith(_FUSED):
            seen.setdefault((path_of(r.path), r.reason), None)
    return tuple(seen)


def attention_lines(reports: tuple[tuple[str, str], ...]) -> list[str]:
    """The table's attention section: one line per module's attention."""
    if not reports:
        return []
    fused = sum(not how.startswith(NOT_FUSED) for _, how in reports)
    return [f"attention: {fused} of {len(reports)} fused"] + [f"  {path or '(top)'}: {how}" for path, how in reports]


def norm_reports(log: Any, path_of: Callable) -> tuple[tuple[str, str], ...]:
    """(module, what) for each layer, RMS or batch norm autocast met: its kind, differentiated
    in closed form or left as written and why (from its log; each module's once)."""
    return tuple(dict.fromkeys((path_of(r.path), r.reason) for r in log if r.primitive == NORM))


def norm_lines(reports: tuple[tuple[str, str], ...]) -> list[str]:
    """The table's norms section: how many are differentiated in closed form, then one line
    per module's norm."""
    if not reports:
        return []
    closed = sum(AS_WRITTEN not in how for _, how in reports)
    return ([f"norms: {closed} of {len(reports)} {CLOSED_FORM}"]
            + [f"  {path or '(top)'}: {how}" for path, how in reports])


class Island(NamedTuple):
    """Ops of one module computed in float32, for one reason."""

    path: str
    reason: str
    primitives: tuple[tuple[str, int], ...]  # (primitive, count)


def islands(log: Any, path_of: Callable) -> tuple[Island, ...]:
    """The float32 islands autocast logged (not matmuls, not attention), grouped by module and reason."""
    grouped: dict[tuple[str, str], collections.Counter] = collections.defaultdict(collections.Counter)
    for r in log:
        if r.dtype == _F32 and r.primitive not in MATMUL_PRIMITIVES and r.primitive not in _REWRITES:
            grouped[(path_of(r.path), r.reason)][r.primitive] += 1
    return tuple(Island(path, reason, tuple(counter.items())) for (path, reason), counter in grouped.items())
