"""Measurements: wall time of compiled calls, activation bytes saved for the
backward pass, XLA's compiled memory and FLOPs, and device peak FLOPs."""

from __future__ import annotations

import contextlib
import io
import re
import statistics
import time
from typing import Any, Callable

import jax
import jax.ad_checkpoint
import numpy as np


def median_seconds(call: Callable[[Any], Any], carry: Any, steps: int, warmup: int = 2) -> tuple[float, Any]:
    """Median wall time of ``carry = call(carry)`` over ``steps`` calls after ``warmup``.

    Each call is waited for (``block_until_ready``), so a time is the device's
    time for one step plus dispatch. Returns the median and the last carry.
    """
    for _ in range(warmup):
        carry = jax.block_until_ready(call(carry))
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        carry = jax.block_until_ready(call(carry))
        times.append(time.perf_counter() - start)
    return statistics.median(times), carry


def alternating_ratio(a: Callable[[Any], Any], a_carry: Any, b: Callable[[Any], Any], b_carry: Any,
                      rounds: int, steps_per_round: int, warmup: int = 2) -> dict[str, Any]:
    """Median over rounds of (time of ``b``) / (time of ``a``), the two timed in turn.

    Each round runs ``steps_per_round`` calls of one then of the other, and the
    order flips every round (ABBA), so drift in machine load hits both alike.
    """
    for _ in range(warmup):
        a_carry = jax.block_until_ready(a(a_carry))
        b_carry = jax.block_until_ready(b(b_carry))

    def run(call, carry):
        start = time.perf_counter()
        for _ in range(steps_per_round):
            carry = jax.block_until_ready(call(carry))
        return (time.perf_counter() - start) / steps_per_round, carry

    ratios, a_times, b_times = [], [], []
    for r in range(rounds):
        if r % 2 == 0:
            ta, a_carry = run(a, a_carry)
            tb, b_carry = run(b, b_carry)
        else:
            tb, b_carry = run(b, b_carry)
            ta, a_carry = run(a, a_carry)
        ratios.append(tb / ta)
        a_times.append(ta)
        b_times.append(tb)
    return {"ratio": statistics.median(ratios), "ratios": ratios,
            "a_seconds": statistics.median(a_times), "b_seconds": statistics.median(b_times)}


_RESIDUAL = re.compile(r"^([a-z]+)(\d*)\[([0-9,]*)\]\s+(.*)$")
_BYTES = {"bool": 1, "pred": 1}


def saved_residuals(fn: Callable, *args: Any) -> list[tuple[str, tuple[int, ...], int, str]]:
    """What reverse-mode differentiation of ``fn(*args)`` keeps for the backward pass.

    Reads :func:`jax.ad_checkpoint.print_saved_residuals` (the traced program's
    residuals, independent of the backend). Returns ``(dtype, shape, bytes,
    source)`` per residual; ``source`` starts with "from the argument" for
    inputs that are kept (params, batch), which are not activations.
    """
    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        jax.ad_checkpoint.print_saved_residuals(fn, *args)
    out = []
    for line in text.getvalue().splitlines():
        match = _RESIDUAL.match(line.strip())
        if match is None:
            continue
        kind, bits, dims, source = match.groups()
        shape = tuple(int(d) for d in dims.split(",") if d)
        itemsize = int(bits) // 8 if bits else _BYTES.get(kind, 4)
        out.append((f"{kind}{bits}", shape, int(np.prod(shape, dtype=np.int64)) * itemsize, source))
    return out


# Where the policy casts params to their compute dtype (precision/modules.py):
# such residuals are weight copies, not activations.
_PARAM_CAST = "_cast_by_path"


def activation_bytes(residuals: list[tuple[str, tuple[int, ...], int, str]]) -> dict[str, Any]:
    """Bytes of saved residuals that are activations, by dtype.

    Counted apart: inputs kept as they are (``argument_bytes``: float32 params,
    the batch) and the policy's compute-dtype copies of the params
    (``param_copy_bytes``), which scale with the model, not the batch.
    """
    by_dtype: dict[str, int] = {}
    arguments = copies = 0
    for dtype, _, nbytes, source in residuals:
        if source.startswith("from the argument"):
            arguments += nbytes
        elif _PARAM_CAST in source:
            copies += nbytes
        else:
            by_dtype[dtype] = by_dtype.get(dtype, 0) + nbytes
    return {"bytes": sum(by_dtype.values()), "by_dtype": by_dtype, "argument_bytes": arguments,
            "param_copy_bytes": copies}


def compiled_memory(compiled: Any) -> dict[str, int | None]:
    """XLA's memory plan of a compiled program: arguments, outputs, temporaries,
    aliased (donated) bytes, their total and, where the backend reports it, the peak."""
    m = compiled.memory_analysis()
    if m is None:
        return {}
    args, outs, temps = m.argument_size_in_bytes, m.output_size_in_bytes, m.temp_size_in_bytes
    alias = getattr(m, "alias_size_in_bytes", 0)
    peak = getattr(m, "peak_memory_in_bytes", None)
    return {"arguments": args, "outputs": outs, "temps": temps, "aliased": alias,
            "total": args + outs + temps - alias, "peak": peak or None}


def _cost(compiled: Any, key: str) -> float | None:
    cost = compiled.cost_analysis()
    if isinstance(cost, (list, tuple)):
        cost = cost[0] if cost else None
    return float(cost[key]) if cost and key in cost else None


def compiled_flops(compiled: Any) -> float | None:
    """FLOPs XLA's cost model counts for a compiled program (all ops, not only matmuls)."""
    return _cost(compiled, "flops")


def compiled_bytes_accessed(compiled: Any) -> float | None:
    """Bytes XLA's cost model says a compiled program reads and writes."""
    return _cost(compiled, "bytes accessed")


# Dense peak FLOP/s per device (vendor datasheets, without sparsity), by the
# precision the matmuls run in: half (bf16/f16), tf32 (f32 at default precision
# on NVIDIA GPUs), f32 (f32 at highest precision).
_PEAKS = (
    ("h100 pcie", {"half": 756e12, "tf32": 378e12, "f32": 51e12}),
    ("h100", {"half": 989e12, "tf32": 494e12, "f32": 67e12}),
    ("h200", {"half": 989e12, "tf32": 494e12, "f32": 67e12}),
    ("a100", {"half": 312e12, "tf32": 156e12, "f32": 19.5e12}),
    ("l4", {"half": 121e12, "tf32": 60e12, "f32": 30e12}),
)


def peak_flops(device: Any, math: str) -> float | None:
    """The device's dense peak FLOP/s for ``math`` ("half", "tf32", "f32"); None if unknown (CPUs)."""
    kind = getattr(device, "device_kind", "").lower()
    if getattr(device, "platform", "") != "gpu":
        return None
    for key, peaks in _PEAKS:
        if key in kind:
            return peaks[math]
    return None
