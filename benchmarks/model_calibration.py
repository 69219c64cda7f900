"""The modeled GPU step time against what a GPU measured: fit and check :mod:`train.inspections.gpu_time`.

Compiles, for an H200 without one, the programs the H200 lease of 2026-11-25
ran (``benchmarks/results/nvidia-h200.json``, ``profile-gpt-mixed_bf16-nvidia-h200.json``):
the suite's GPT at its ``gpu`` size under mixed_bf16, fp32 and mixed_f16 (with
and without dynamic loss scaling), its pinned-dtype twin, and the suite's
hand-written JAX + optax step. Then:

1. **fits** the model's numbers on the profile of the mixed_bf16 step: the
   share of peak its GEMMs and cuDNN's attention reached (their measured time)
   and the gap between kernels (wall time less busy time, per launch); a
   memory-bound kernel's latency and streaming share are fitted kernel by kernel
   on the H200's GPT-2-small profiles (``python -m benchmarks.kernel_bandwidth``,
   ``kernel-bandwidth.json``) and read from there;
2. says how far the fitted model is from each measured kernel kind;
3. **checks** it on the steps it was not fitted on: modeled against measured
   step time for each.

    python -m benchmarks.model_calibration [--programs DIR] [--out DIR]

The fit is only right on the program that was measured: compile the steps in a checkout of
the commit the GPU ran (for the H200 run of 2026-11-25, c7177cb) and give them with
``--programs DIR`` (``DIR/<model>-<policy>-<loss scale>-<rules|norules>.hlo``,
``DIR/hand_written-gpt.hlo``); without it the steps are compiled here, a program the GPU
never ran. The commit compiled is written into the result. Needs JAX's CUDA plugin (``pip install '.[gpu-compile]'``;
``JAX_PLATFORMS=cpu``). Writes ``model-calibration.{json,md}``; the fitted numbers belong in
``train.inspections.gpu_time.CALIBRATION`` (rounded).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys
from typing import Any

import jax
import jax.numpy as jnp
import optax

from benchmarks import suite
from benchmarks.profile_step import profile_kind
from benchmarks.report import RESULTS, environment, write_tables
from benchmarks.workloads import workload
from train import create_train_state
from train.inspections.compile_for import compile_train_step
from train.parallel.distributed import Layout, make_mesh
from train.inspections.gpu_time import CALIBRATION, Calibration, datasheet, model_kernels, model_step
from train.inspections.hlo_kernels import HloKernel, read_hlo_kernels
from train.inspections.targets import get_target, target_devices

PROFILE = RESULTS / "profile-gpt-mixed_bf16-nvidia-h200.json"
MEASURED = RESULTS / "nvidia-h200.json"
MEMORY = RESULTS / "kernel-bandwidth.json"
PROFILE_KINDS = ("gemm", "attention", "fusion", "reduction", "copy")


def _ours(model: str, policy: str, loss_scale: str, rules: Any, target: Any, layout: Layout) -> str:
    w = workload(model, "gpu")
    sample = jnp.zeros((1, *w.inputs.shape[1:]), w.inputs.dtype)
    state = jax.eval_shape(lambda: create_train_state(w.model, policy, suite._optimizer(), jax.random.key(0), sample,
                                                      loss_scale=loss_scale, rules=rules))
    batch = {"inputs": w.inputs, "labels": jax.ShapeDtypeStruct(w.inputs.shape, jnp.int32)}
    return compile_train_step(state, batch, layout, target, task="language_model").hlo_text


def _hand_written(model: str, layout: Layout) -> str:
    """The suite's hand-written step (``benchmarks.suite._hand_written_step``), compiled."""
    w, made = workload(model, "gpu"), {}

    def state():
        variables = suite.initial_variables(w)
        made["step"], carry = suite._hand_written_step(w, jnp.bfloat16, variables["params"],
                                                       {k: v for k, v in variables.items() if k != "params"})
        return carry

    carry = jax.eval_shape(state)
    batch = {"inputs": w.inputs, "labels": jax.ShapeDtypeStruct(w.inputs.shape, jnp.int32)}
    placed = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=layout.replicated()),
                                    (carry, batch))
    return made["step"].lower(*placed).compile().as_text()


def _busy(kernels: list[HloKernel], sheet: Any, calibration: Calibration) -> float:
    """Modeled busy seconds (without the gaps between kernels)."""
    return sum(m.seconds - calibration.gap_seconds * m.kernel.launches
               for m in model_kernels(kernels, sheet, calibration))


def fit(kernels: list[HloKernel], profile: dict[str, Any], sheet: Any, memory: dict[str, Any]) -> Calibration:
    """The calibration that gives ``kernels`` the profile's GEMM and attention time, its gap per launch,
    and ``memory``'s latency and streaming share (``kernel-bandwidth.json``; see the module's docstring)."""
    launches = sum(k.launches for k in kernels)
    calibration = CALIBRATION._replace(min_kernel_seconds=memory["latency_seconds"],
                                       bandwidth_efficiency=memory["share"],
                                       source=f"{PROFILE.stem} ({profile['environment']['date']}); {MEMORY.stem}",
                                       gap_seconds=(profile["step_seconds_traced"] - profile["busy_seconds"]) / launches)
    for field, kinds in (("gemm_efficiency", ("gemm",)), ("attention_efficiency", ("attention",))):
        chosen = [k for k in kernels if profile_kind(k) in kinds]
        want = sum(profile["by_kind"].get(kind, 0.0) for kind in kinds)
        low, high = 1e-3, 2.0
        for _ in range(60):  # the modeled time falls as the efficiency rises: bisect
            mid = (low + high) / 2
            calibration = calibration._replace(**{field: mid})
            low, high = (mid, high) if _busy(chosen, sheet, calibration) > want else (low, mid)
    return calibration


def _program(programs: str | None, model: str, policy: str, loss_scale: str, rules: Any, target: Any,
             layout: Layout) -> str:
    """The optimized HLO of a checked step: ``programs/<name>.hlo`` where given (compiled in a
    checkout of the measured commit), else compiled here (``policy`` ``hand_written``: the suite's
    hand-written step)."""
    name = "hand_written-gpt" if policy == "hand_written" else \
        f"{model}-{policy}-{loss_scale}-{'norules' if rules == () else 'rules'}"
    if programs:
        return (pathlib.Path(programs) / f"{name}.hlo").read_text()
    if policy == "hand_written":
        return _hand_written(model, layout)
    return _ours(model, policy, loss_scale, rules, target, layout)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(prog="python -m benchmarks.model_calibration", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(RESULTS))
    p.add_argument("--programs", default=None, help="a directory of the checked steps' HLO (<model>-<policy>-"
                   "<loss scale>-<rules|norules>.hlo, hand_written-gpt.hlo) compiled at the measured commit")
    args = p.parse_args(argv)
    target = get_target("h200")
    layout = Layout(make_mesh(1, 1, target_devices(target)))
    sheet, profile, measured = datasheet(target), json.loads(PROFILE.read_text()), json.loads(MEASURED.read_text())
    kernels = read_hlo_kernels(_program(args.programs, "gpt", "mixed_bf16", "none", None, target, layout))
    calibration = fit(kernels, profile, sheet, json.loads(MEMORY.read_text()))
    kinds = [{"kind": kind, "measured": profile["by_kind"].get(kind, 0.0),
              "modeled": _busy([k for k in kernels if profile_kind(k) == kind], sheet, calibration),
              "launches": sum(k.launches for k in kernels if profile_kind(k) == kind)} for kind in PROFILE_KINDS]
    rows = {(r["model"], r["policy"]): r["step_seconds"] for r in measured["rows"]}
    overhead, scaled = measured["overhead"][0], measured["loss_scale_overhead"][0]
    checks = [("gpt", "mixed_bf16", "none", None, rows[("gpt", "mixed_bf16")], "the fitted step (suite median)"),
              ("gpt", "mixed_bf16", "none", (), overhead["ours_seconds"], "ours in the overhead run"),
              ("gpt", "fp32", "none", None, rows[("gpt", "fp32")], "TF32 GEMMs"),
              ("gpt_pinned", "mixed_bf16", "none", None, rows[("gpt_pinned", "mixed_bf16")], ""),
              ("gpt_pinned", "fp32", "none", None, rows[("gpt_pinned", "fp32")], ""),
              ("gpt", "mixed_f16", "none", None, scaled["none_seconds"], "loss-scale run"),
              ("gpt", "mixed_f16", "dynamic", None, scaled["dynamic_seconds"], "loss-scale run")]
    steps = []
    for model, policy, loss_scale, rules, seconds, note in checks:
        modeled = model_step(_program(args.programs, model, policy, loss_scale, rules, target, layout), target,
                             calibration)
        steps.append({"step": f"{model} {policy}" + (f" ({loss_scale} loss scale)" if loss_scale != "none" else ""),
                      "note": note, "measured": seconds, "modeled": modeled.seconds})
    hand = model_step(_program(args.programs, "gpt", "hand_written", "none", None, target, layout), target, calibration)
    steps.append({"step": "gpt hand-written bf16", "note": "the overhead run", "measured":
                  overhead["hand_written_seconds"], "modeled": hand.seconds})
    result = {"calibration": calibration._asdict(), "kinds": kinds, "steps": steps, "environment": environment(),
              "commit": "c7177cb (programs compiled there)" if args.programs else _commit(),
              "profile": {"busy": profile["busy_seconds"], "wall": profile["step_seconds_traced"],
                          "launches_modeled": sum(k.launches for k in kernels)}}
    write_tables(args.out, "model-calibration", result, markdown(result))
    return result


def _commit() -> str:
    """The commit whose code was compiled (the checkout this module runs from)."""
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True,
                             cwd=pathlib.Path(__file__).resolve().parent)
        return out.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def markdown(result: dict[str, Any]) -> str:
    c, prof = result["calibration"], result["profile"]
    lines = ["# The modeled GPU step time against the H200's measurements", "",
             f"`python -m benchmarks.model_calibration` at commit {result['commit']} (jax "
             f"{result['environment']['jax']} here, compile-only H200; the measurements: that commit, jax 0.11.2 on an "
             f"H200, 2026-11-25). The model (`train.inspections.gpu_time`) gives each kernel "
             "max(t_0 + bytes / (bandwidth x e_bw), FLOPs / (peak x e)) plus the gap between kernels.", "",
             f"Fitted on the profile of the GPT's mixed_bf16 step (busy {prof['busy'] * 1e3:.2f} ms, wall "
             f"{prof['wall'] * 1e3:.2f} ms): GEMMs reach {c['gemm_efficiency']:.3f} of the dense peak, cuDNN attention "
             f"{c['attention_efficiency']:.3f} (of a causal half of the FLOPs); gap {c['gap_seconds'] * 1e6:.2f} us per "
             f"launch ({prof['launches_modeled']} launches in the program compiled here). A kernel's latency "
             f"t_0 = {c['min_kernel_seconds'] * 1e6:.2f} us and its bytes' share of HBM bandwidth "
             f"e_bw = {c['bandwidth_efficiency']:.3f} are fitted kernel by kernel on the H200's GPT-2-small profiles "
             "(`kernel-bandwidth.md`), not here.", "",
             "| kernel kind | launches | measured ms | modeled ms | model / measured |", "|---|---|---|---|---|"]
    for k in result["kinds"]:
        ratio = f"{k['modeled'] / k['measured']:.2f}" if k["measured"] else "-"
        lines.append(f"| {k['kind']} | {k['launches']} | {k['measured'] * 1e3:.2f} | {k['modeled'] * 1e3:.2f} | "
                     f"{ratio} |")
    lines += ["", "GEMM and attention are fitted exactly (one number each); the fusion, reduction and copy rows are "
              "not fitted here (the latency and share of `kernel-bandwidth.md`): they say how far those two numbers "
              "are from this profile's kernels of each kind. The profile counts "
              "cuDNN's `compute_dot_do_o` helper as a GEMM and its dq conversion as attention.", "",
              "Steps the model was not fitted on (measured: the medians of `benchmarks/results/nvidia-h200.json`):", "",
              "| step | measured ms | modeled ms | model / measured | note |", "|---|---|---|---|---|"]
    for s in result["steps"]:
        lines.append(f"| {s['step']} | {s['measured'] * 1e3:.2f} | {s['modeled'] * 1e3:.2f} | "
                     f"{s['modeled'] / s['measured']:.2f} | {s['note']} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
    sys.exit(0)
