"""Where a train step's time goes: the top device ops of one benchmark case.

Traces a few steps of a suite workload (the same program ``python -m benchmarks``
times, so a shared compilation cache loads it) with :func:`jax.profiler.trace`,
reads the trace back with :class:`jax.profiler.ProfileData` and sums the time of
each kernel on the device's streams. Prints and saves a table: the top kernels by
time per step, their share of the device's busy time, and the time by kind
(GEMMs, cuDNN attention, other fusions, copies).

    python -m benchmarks.profile_step [--model gpt] [--size gpu] [--policy mixed_bf16] [--steps 5]
                                      [--hand-written] [--out DIR]

On a CPU the device plane is absent and the host's XLA op events are summed
instead (times then mean little; the script is checked there).
"""

from __future__ import annotations

import argparse
import collections
import pathlib
import tempfile
import time
from typing import Any, Callable

import jax

from benchmarks import suite
from benchmarks.report import RESULTS, device_slug, environment, write_tables
from benchmarks.workloads import MODELS, POLICY_NAMES, SIZES, policy_case, workload
from train.experiment import compile_cache

_KINDS = (("attention", ("sdpa", "fmha", "flash", "attention", "cudnn::fusion")),
          ("gemm", ("gemm", "xmma", "cutlass", "nvjet", "cublas", "matmul", "dot")),
          ("copy", ("memcpy", "memset", "copy")),
          ("reduction", ("reduce", "reduction")))


def kind_of(kernel: str) -> str:
    """A coarse kind for a kernel name: gemm, attention, copy, reduction or fusion."""
    lower = kernel.lower()
    for kind, marks in _KINDS:
        if any(m in lower for m in marks):
            return kind
    return "fusion"


def profile_kind(kernel: Any) -> str:
    """The kind this profile gives a :class:`train.inspections.hlo_kernels.HloKernel` (by its HLO name, as
    :func:`kind_of` does a kernel's name; GEMMs, attention and copies by what they are)."""
    return kernel.kind if kernel.kind in ("gemm", "attention", "copy") else kind_of(kernel.name)


def modeled(hlo_text: str, device_kind: str) -> dict[str, Any] | None:
    """``train.inspections.gpu_time``'s modeled time of the compiled step, by this profile's kinds, for an
    H100 or H200 (None elsewhere): beside a measured profile, the model's calibration data."""
    from train.inspections.gpu_time import model_step
    from train.inspections.targets import get_target

    name = next((n for n in ("h100", "h200") if n in device_kind.lower()), None)
    if name is None:
        return None
    step = model_step(hlo_text, get_target(name))
    by_kind: dict[str, float] = collections.Counter()
    for m in step.kernels:
        by_kind[profile_kind(m.kernel)] += m.seconds - step.calibration.gap_seconds * m.kernel.launches
    return {"what": "a model of the compiled program, not a measurement", "seconds": step.seconds,
            "launches": step.launches, "busy_by_kind": dict(by_kind)}


def kernel_times(trace_dir: str) -> tuple[dict[str, float], str]:
    """Seconds per kernel name summed over a trace's device streams, and which
    events were read ("device streams" on a GPU; the host's XLA threads on a CPU)."""
    paths = sorted(pathlib.Path(trace_dir).rglob("*.xplane.pb"))
    if not paths:
        raise FileNotFoundError(f"no *.xplane.pb under {trace_dir}: did the profiler write a trace?")
    data = jax.profiler.ProfileData.from_file(str(paths[-1]))
    device = [line for plane in data.planes if plane.name.startswith("/device:") for line in plane.lines]
    host = [line for plane in data.planes if plane.name.startswith("/host:CPU") for line in plane.lines]
    for source, lines in (("device streams", [ln for ln in device if ln.name.startswith("Stream")]),
                          ("device XLA ops", [ln for ln in device if ln.name == "XLA Ops"]),
                          ("host XLA threads", [ln for ln in host if ln.name.startswith("tf_XLA")])):
        totals: dict[str, float] = collections.Counter()
        for line in lines:
            for event in line.events:
                totals[event.name] += event.duration_ns * 1e-9
        if totals:
            return dict(totals), source
    return {}, "no events"


def traced(run: Callable[[], Any], steps: int) -> dict[str, Any]:
    """Runs ``run`` (``steps`` steps; it returns what to wait for) under the profiler: the wall
    seconds a step, and the device's busy seconds a step by kernel name and by kind."""
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir):
            start = time.perf_counter()
            jax.block_until_ready(run())
            wall = (time.perf_counter() - start) / steps
        totals, source = kernel_times(trace_dir)
    per_step = {name: seconds / steps for name, seconds in totals.items()}
    by_kind: dict[str, float] = collections.Counter()
    for name, seconds in per_step.items():
        by_kind[kind_of(name)] += seconds
    return {"source": source, "wall_seconds": wall, "busy_seconds": sum(per_step.values()), "per_step": per_step,
            "by_kind": dict(sorted(by_kind.items(), key=lambda item: -item[1]))}


def profile(model: str, size: str, policy: str, steps: int, hand_written: bool = False) -> dict[str, Any]:
    """Traces ``steps`` train steps of ``model`` under ``policy`` (``hand_written``: the suite's
    hand-written JAX + optax bf16 step instead of ours); the kernels' times per step."""
    w = workload(model, size)
    if hand_written:
        _, prepared = suite.prepare_overhead(w, suite.initial_variables(w))
        policy = "hand_written_bf16"
    else:
        prepared = suite.prepare_case(w, policy_case(policy), suite.initial_variables(w))
    state, batch, step = prepared.state, prepared.batch, prepared.step
    for _ in range(3):  # warm-up: autotuning and first-call work stay out of the trace
        state, _ = step(state, batch)
    jax.block_until_ready(state)

    def run():
        nonlocal state
        for _ in range(steps):
            state, _ = step(state, batch)
        return state

    t = traced(run, steps)
    busy = t["busy_seconds"]
    top = sorted(t["per_step"].items(), key=lambda item: -item[1])
    return {"model": model, "size": size, "policy": policy, "steps": steps, "source": t["source"],
            "step_seconds_traced": t["wall_seconds"], "busy_seconds": busy, "kernels": len(t["per_step"]),
            "modeled": modeled(step.as_text(), jax.devices()[0].device_kind), "by_kind": t["by_kind"],
            "top": [{"kernel": name, "kind": kind_of(name), "seconds": seconds, "share": seconds / busy if busy else 0.0}
                    for name, seconds in top]}


def markdown(result: dict[str, Any], top: int = 15) -> str:
    """The profile as a Markdown table."""
    lines = [f"# Profile: {result['model']} ({result['size']}) under {result['policy']}", "",
             f"device: {result['device']}; {result['steps']} traced steps, {result['source']}; "
             f"step {1e3 * result['step_seconds_traced']:.2f} ms wall while tracing, device busy "
             f"{1e3 * result['busy_seconds']:.2f} ms per step in {result['kernels']} distinct kernels", "",
             "| kind | ms per step | share of busy | modeled ms (not measured) |", "| --- | ---: | ---: | ---: |"]
    busy = result["busy_seconds"] or 1.0
    model = (result.get("modeled") or {}).get("busy_by_kind", {})
    lines += [f"| {kind} | {1e3 * s:.2f} | {100 * s / busy:.1f}% | "
              f"{f'{1e3 * model[kind]:.2f}' if kind in model else '-'} |" for kind, s in result["by_kind"].items()]
    lines += ["", "| kernel | kind | ms per step | share of busy |", "| --- | --- | ---: | ---: |"]
    lines += [f"| `{k['kernel'][:90]}` | {k['kind']} | {1e3 * k['seconds']:.3f} | {100 * k['share']:.1f}% |"
              for k in result["top"][:top]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(prog="python -m benchmarks.profile_step", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=MODELS, default="gpt")
    p.add_argument("--size", choices=SIZES, default="gpu")
    p.add_argument("--policy", choices=POLICY_NAMES, default="mixed_bf16")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--hand-written", action="store_true",
                   help="profile the suite's hand-written JAX + optax bf16 step instead of ours")
    p.add_argument("--out", default=str(RESULTS))
    args = p.parse_args(argv)
    compile_cache.enable()
    env = environment()
    result = profile(args.model, args.size, args.policy, args.steps, args.hand_written) | {
        "device": jax.devices()[0].device_kind, "environment": env}
    write_tables(args.out, f"profile-{args.model}-{result['policy']}-{device_slug(env)}", result, markdown(result))
    return result


if __name__ == "__main__":
    main()
