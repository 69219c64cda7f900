"""Measurements: wall time of compiled calls, activation bytes saved for the
backward pass, XLA's compiled memory and FLOPs, and device peak FLOPs."""

from __future__ import annotations

import contextlib
import io
import re
import statistics
import threading
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


def back_to_back_seconds(call: Callable[[Any], Any], carry: Any, steps: int, rounds: int = 3) -> tuple[float, Any]:
    """Seconds per call of ``carry = call(carry)`` run ``steps`` times back to back and
    waited for once, as a training loop runs steps; the median over ``rounds``. Returns
    it and the last carry."""
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(steps):
            carry = call(carry)
        carry = jax.block_until_ready(carry)
        times.append((time.perf_counter() - start) / steps)
    return statistics.median(times), carry


def in_tree_of(like: Any, state: Any) -> Any:
    """``state``'s arrays in the tree of ``like`` (its ``jax.eval_shape``, which a step was compiled
    for): a state created again has new static parts (an optimizer's functions) that a compiled
    step, matching its tree exactly, would refuse."""
    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(like), jax.tree_util.tree_leaves(state))


def alternating_ratio(a: Callable[[Any], Any], a_carry: Any, b: Callable[[Any], Any], b_carry: Any,
                      rounds: int, steps_per_round: int, warmup: int = 2) -> dict[str, Any]:
    """Median over rounds of (time of ``b``) / (time of ``a``), the two timed in turn.

    Each round runs ``steps_per_round`` calls of one then of the other, and the
    order flips every round (ABBA), so drift in machine load hits both alike. The
    calls of a round run back to back, waited for at its end, as a training loop
    runs them: a step's host-side dispatch overlaps the device's work on the one
    before, so a per-step wait does not charge the dispatch of a larger state twice.
    """
    for _ in range(warmup):
        a_carry = jax.block_until_ready(a(a_carry))
        b_carry = jax.block_until_ready(b(b_carry))

    def run(call, carry):
        start = time.perf_counter()
        for _ in range(steps_per_round):
            carry = call(carry)
        carry = jax.block_until_ready(carry)
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
            "a_seconds": statistics.median(a_times), "b_seconds": statistics.median(b_times),
            "a_carry": a_carry, "b_carry": b_carry}


def _residuals_api() -> Callable[..., list[tuple[Any, str]]] | None:
    """JAX's data-returning ``saved_residuals(fn, *args) -> [(aval, source), ...]``:
    public in newer JAX, internal (``jax._src.ad_checkpoint``) in older; None if neither."""
    public = getattr(jax.ad_checkpoint, "saved_residuals", None)
    if public is not None:
        return public
    try:
        from jax._src import ad_checkpoint as internal
    except ImportError:  # pragma: no cover - a JAX without the internal module
        return None
    return getattr(internal, "saved_residuals", None)


def _short_dtype(dtype: Any) -> str:
    """``float32`` -> ``f32``, ``bfloat16`` -> ``bf16``, ``int8`` -> ``i8``, ``uint8`` -> ``u8``, ``bool``."""
    name = np.dtype(dtype).name
    for long, short in (("complex", "c"), ("float", "f"), ("uint", "u"), ("int", "i")):
        name = name.replace(long, short)
    return name


def _residual_row(shape: Any, dtype: Any, source: str) -> tuple[str, tuple[int, ...], int, str] | None:
    if jax.dtypes.issubdtype(dtype, jax.dtypes.extended):  # PRNG keys: not activations, no itemsize
        return None
    shape = tuple(int(d) for d in shape)
    nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
    return _short_dtype(dtype), shape, nbytes, source


_RESIDUAL = re.compile(r"^([a-z]+\d*)\[([0-9,]*)\]\s+(.*)$")
_PRINT_LOCK = threading.Lock()


def _printed_residuals(fn: Callable, *args: Any) -> list[tuple[str, tuple[int, ...], int, str]]:
    """Fallback for a JAX with no data API: parses ``print_saved_residuals``, one
    thread at a time (``redirect_stdout`` swaps the process-wide ``sys.stdout``)."""
    text = io.StringIO()
    with _PRINT_LOCK, contextlib.redirect_stdout(text):
        jax.ad_checkpoint.print_saved_residuals(fn, *args)
    out = []
    for line in text.getvalue().splitlines():
        match = _RESIDUAL.match(line.strip())
        if match is None:
            continue
        name, dims, source = match.groups()
        kind, bits = re.match(r"([a-z]+)(\d*)$", name).groups()
        long = {"f": "float", "bf": "bfloat", "i": "int", "u": "uint", "c": "complex"}.get(kind, kind)
        row = _residual_row([d for d in dims.split(",") if d], jax.numpy.dtype(long + bits), source)
        if row is not None:
            out.append(row)
    return out


def saved_residuals(fn: Callable, *args: Any) -> list[tuple[str, tuple[int, ...], int, str]]:
    """What reverse-mode differentiation of ``fn(*args)`` keeps for the backward pass.

    Reads JAX's ``saved_residuals`` (the data behind
    :func:`jax.ad_checkpoint.print_saved_residuals`: the traced program's
    residuals, independent of the backend) as data, so it is safe to call from
    several threads at once. Returns ``(dtype, shape, bytes, source)`` per
    residual (``dtype`` short, as JAX prints it: ``f32``, ``bf16``, ``bool``);
    ``source`` starts with "from the argument" for inputs that are kept (params,
    batch), which are not activations. PRNG-key residuals are left out.
    """
    api = _residuals_api()
    if api is None:  # pragma: no cover - depends on the JAX version
        return _printed_residuals(fn, *args)
    out = []
    for aval, source in api(fn, *args):
        shape, dtype = getattr(aval, "shape", None), getattr(aval, "dtype", None)
        if shape is None or dtype is None:
            continue
        row = _residual_row(shape, dtype, source)
        if row is not None:
            out.append(row)
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
    words = re.split(r"[^a-z0-9]+", kind)
    for key, peaks in _PEAKS:  # whole words: "l4" is not "NVIDIA L40S"
        if all(word in words for word in key.split()):
            return peaks[math]
    return None


def modeled_step(compiled_text: str, device: Any) -> dict[str, Any] | None:
    """:mod:`train.inspections.gpu_time`'s modeled time of a compiled step on ``device``
    (an H100 or H200; None elsewhere): a model of the program, **not a measurement**,
    set beside the measured time to check the model. A program the model cannot
    read gives ``{"error": ...}`` rather than stopping the benchmark."""
    from train.inspections.gpu_time import model_step
    from train.inspections.targets import get_target

    kind = getattr(device, "device_kind", "").lower()
    name = next((n for n in ("h100", "h200") if n in kind), None)
    if name is None or getattr(device, "platform", "") != "gpu":
        return None
    try:
        step = model_step(compiled_text, get_target(name))
    except Exception as error:  # noqa: BLE001 - the model is a side note to the measurement
        return {"error": f"{type(error).__name__}: {error}"}
    return {"seconds": step.seconds, "launches": step.launches, "target": name}
