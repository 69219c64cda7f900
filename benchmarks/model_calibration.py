"""The modeled GPU step time against what a GPU measured: fit and check :mod:`train.inspections.gpu_time`.

Reads what an H200 lease measured (by default that of 2026-11-28: GPT-2 small at its real
vocabulary; the suite's rows, the profiles of our mixed_bf16 step and of the hand-written one)
and the programs it ran, then:

1. **fits** the model's numbers on the profile of our mixed_bf16 step: the share of peak its
   GEMMs and cuDNN's attention reached (their measured time) and the gap between kernels (wall
   time less busy time, per launch); a memory-bound kernel's latency and streaming share are
   fitted kernel by kernel on the H200's GPT-2-small profiles (``python -m
   benchmarks.kernel_bandwidth``, ``kernel-bandwidth.json``) and read from there;
2. says how far the fitted model is from each measured kernel kind, on our step and on the
   hand-written one (not fitted on);
3. **checks** it on the steps it was not fitted on (every row, waited and back to back; ours
   and hand-written, alternating and each on its own; the loss-scale pair), and gives the
   ratio ours / hand-written as modeled and as measured.

    python -m benchmarks.model_calibration [--programs DIR] [--profile P] [--hand-profile P]
        [--measured JSON] [--model gpt2_small] [--out DIR]

The fit is only right on the program that was measured: a lease saves the programs it ran
(``python -m benchmarks --save-programs DIR``, which ``gpu_session.sh`` passes), or compile the
steps in a checkout of the commit the GPU ran, and give them with ``--programs DIR``
(``DIR/<model>-<policy>-<loss scale>-<rules|norules>.hlo``, ``DIR/hand_written-<model>.hlo``).
Without it the steps are compiled here, a program the GPU never ran, which needs JAX's CUDA plugin
(``pip install '.[gpu-compile]'``; ``JAX_PLATFORMS=cpu``). Writes ``model-calibration.{json,md}``;
the fitted numbers belong in ``train.inspections.gpu_time.CALIBRATION`` (rounded).
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

#: The lease whose steps the model is fitted on and checked against (H200, 2026-11-28: GPT-2 small at its
#: real vocabulary, the programs of commit 0ef28be): our step's profile (fitted), the hand-written step's
#: profile and the suite's measured rows (checked).
PROFILE = RESULTS / "profile-gpt2_small-mixed_bf16-nvidia-h200.json"
HAND_PROFILE = RESULTS / "profile-gpt2_small-hand_written_bf16-nvidia-h200.json"
MEASURED = RESULTS / "nvidia-h200-gpt2_small-2026-11-28.json"
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


def fit(kernels: list[HloKernel], profile: dict[str, Any], sheet: Any, memory: dict[str, Any],
        profile_name: str = PROFILE.stem) -> Calibration:
    """The calibration that gives ``kernels`` the profile's GEMM and attention time, its gap per launch,
    and ``memory``'s latency and streaming share (``kernel-bandwidth.json``; see the module's docstring)."""
    launches = sum(k.launches for k in kernels)
    calibration = CALIBRATION._replace(min_kernel_seconds=memory["latency_seconds"],
                                       bandwidth_efficiency=memory["share"],
                                       source=f"{profile_name} ({profile['environment']['date']}); {MEMORY.stem}",
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
             layout: Layout | None) -> str:
    """The optimized HLO of a checked step: ``programs/<name>.hlo`` where given (compiled in a
    checkout of the measured commit), else compiled here (``policy`` ``hand_written``: the suite's
    hand-written step)."""
    name = f"hand_written-{model}" if policy == "hand_written" else \
        f"{model}-{policy}-{loss_scale}-{'norules' if rules == () else 'rules'}"
    if programs:
        return (pathlib.Path(programs) / f"{name}.hlo").read_text()
    if policy == "hand_written":
        return _hand_written(model, layout)
    return _ours(model, policy, loss_scale, rules, target, layout)


def _kinds(kernels: list[HloKernel], profile: dict[str, Any], sheet: Any, calibration: Calibration) -> list[dict]:
    """Per kernel kind: the profile's measured busy time beside the model's."""
    return [{"kind": kind, "measured": profile["by_kind"].get(kind, 0.0),
             "modeled": _busy([k for k in kernels if profile_kind(k) == kind], sheet, calibration),
             "launches": sum(k.launches for k in kernels if profile_kind(k) == kind)} for kind in PROFILE_KINDS]


def _checks(measured: dict[str, Any], model: str) -> list[tuple]:
    """(policy, loss scale, rules, measured seconds, note) of every step the suite measured for ``model``."""
    checks = []
    for r in measured["rows"]:
        if r["model"] == model:
            checks.append((r["policy"], r["loss_scale"], None, r["step_seconds"], "suite row, each step waited for"))
            if r.get("step_seconds_back_to_back"):
                checks.append((r["policy"], r["loss_scale"], None, r["step_seconds_back_to_back"],
                               "suite row, back to back"))
    overhead = next(o for o in measured["overhead"] if o["model"] == model)
    checks += [("mixed_bf16", "none", (), overhead["ours_seconds"], "ours, alternating with hand-written"),
               ("hand_written", "none", None, overhead["hand_written_seconds"], "hand-written, alternating with ours")]
    for key, label in (("back_to_back", "back to back"), ("waited", "each step waited for")):
        if f"ours_{key}_seconds" in overhead:
            checks += [("mixed_bf16", "none", (), overhead[f"ours_{key}_seconds"], f"ours on its own, {label}"),
                       ("hand_written", "none", None, overhead[f"hand_written_{key}_seconds"],
                        f"hand-written on its own, {label}")]
    scaled = next(o for o in measured["loss_scale_overhead"] if o["model"] == model)
    checks += [("mixed_f16", "none", None, scaled["none_seconds"], "loss-scale run"),
               ("mixed_f16", "dynamic", None, scaled["dynamic_seconds"], "loss-scale run")]
    return checks


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(prog="python -m benchmarks.model_calibration", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(RESULTS))
    p.add_argument("--model", default="gpt2_small", help="the suite's model the lease measured")
    p.add_argument("--profile", default=str(PROFILE), help="our mixed_bf16 step's profile (fitted on)")
    p.add_argument("--hand-profile", default=str(HAND_PROFILE), help="the hand-written step's profile (checked)")
    p.add_argument("--measured", default=str(MEASURED), help="the suite's results of that lease (checked)")
    p.add_argument("--programs", default=None, help="a directory of the checked steps' optimized HLO (<model>-<policy>-"
                   "<loss scale>-<rules|norules>.hlo, hand_written-<model>.hlo): the programs the GPU ran, saved "
                   "by the lease (benchmarks --save-programs) or compiled at its commit")
    p.add_argument("--programs-from", default=None, help="where --programs came from, for the report")
    p.add_argument("--name", default="model-calibration", help="the result files' name (NAME.json, NAME.md)")
    args = p.parse_args(argv)
    target = get_target("h200")
    layout = None if args.programs else Layout(make_mesh(1, 1, target_devices(target)))  # only to compile here
    sheet = datasheet(target)
    profile, hand_profile = json.loads(pathlib.Path(args.profile).read_text()), json.loads(
        pathlib.Path(args.hand_profile).read_text())
    measured = json.loads(pathlib.Path(args.measured).read_text())
    program = lambda policy, loss_scale, rules: _program(args.programs, args.model, policy, loss_scale, rules, target,
                                                         layout)
    kernels = read_hlo_kernels(program("mixed_bf16", "none", None))
    hand_kernels = read_hlo_kernels(program("hand_written", "none", None))
    calibration = fit(kernels, profile, sheet, json.loads(MEMORY.read_text()), pathlib.Path(args.profile).stem)
    modeled: dict[tuple, float] = {}
    steps = []
    for policy, loss_scale, rules, seconds, note in _checks(measured, args.model):
        key = (policy, loss_scale, rules)
        if key not in modeled:
            modeled[key] = model_step(program(*key), target, calibration).seconds
        name = "hand-written bf16" if policy == "hand_written" else policy
        steps.append({"step": f"{args.model} {name}" + (f" ({loss_scale} loss scale)" if loss_scale != "none" else ""),
                      "note": note, "measured": seconds, "modeled": modeled[key]})
    overhead = next(o for o in measured["overhead"] if o["model"] == args.model)
    ratio = {"modeled": modeled[("mixed_bf16", "none", ())] / modeled[("hand_written", "none", None)],
             "measured_alternating": overhead["ratio"],
             "measured_back_to_back": overhead.get("back_to_back_ratio"),
             "profiles_wall": profile["step_seconds_traced"] / hand_profile["step_seconds_traced"],
             "profiles_busy": profile["busy_seconds"] / hand_profile["busy_seconds"]}
    result = {"calibration": calibration._asdict(), "kinds": _kinds(kernels, profile, sheet, calibration),
              "hand_kinds": _kinds(hand_kernels, hand_profile, sheet, calibration), "steps": steps, "ratio": ratio,
              "environment": environment(), "measured_environment": measured["environment"],
              "inputs": {"profile": pathlib.Path(args.profile).name, "hand_profile": pathlib.Path(args.hand_profile).name,
                         "measured": pathlib.Path(args.measured).name},
              "commit": args.programs_from or (f"programs from {args.programs}" if args.programs
                                               else f"{_commit()} (compiled here)"),
              "profile": {"busy": profile["busy_seconds"], "wall": profile["step_seconds_traced"],
                          "launches_modeled": sum(k.launches for k in kernels)}}
    write_tables(args.out, args.name, result, markdown(result))
    return result


def _commit() -> str:
    """The commit whose code was compiled (the checkout this module runs from)."""
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True,
                             cwd=pathlib.Path(__file__).resolve().parent)
        return out.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _kind_table(kinds: list[dict]) -> list[str]:
    lines = ["| kernel kind | launches | measured ms | modeled ms | model / measured |", "|---|---|---|---|---|"]
    for k in kinds:
        ratio = f"{k['modeled'] / k['measured']:.2f}" if k["measured"] else "-"
        lines.append(f"| {k['kind']} | {k['launches']} | {k['measured'] * 1e3:.2f} | {k['modeled'] * 1e3:.2f} | "
                     f"{ratio} |")
    return lines


def markdown(result: dict[str, Any]) -> str:
    c, prof, inputs, env = result["calibration"], result["profile"], result["inputs"], result["measured_environment"]
    r = result["ratio"]
    lines = ["# The modeled GPU step time against the H200's measurements", "",
             f"`python -m benchmarks.model_calibration`: programs {result['commit']}, read here by jax "
             f"{result['environment']['jax']}'s compile-only H200 client; the measurements: jax {env['jax']} on an "
             f"{env['device']}, {env['date']} (`{inputs['measured']}`, `{inputs['profile']}`, "
             f"`{inputs['hand_profile']}`). The model (`train.inspections.gpu_time`) gives each kernel "
             "max(t_0 + bytes / (bandwidth x e_bw), FLOPs / (peak x e)) plus the gap between kernels.", "",
             f"Fitted on the profile of our mixed_bf16 step (busy {prof['busy'] * 1e3:.2f} ms, wall "
             f"{prof['wall'] * 1e3:.2f} ms back to back): GEMMs reach {c['gemm_efficiency']:.3f} of the dense peak, "
             f"cuDNN attention {c['attention_efficiency']:.3f} (of a causal half of the FLOPs); gap "
             f"{c['gap_seconds'] * 1e6:.2f} us per launch ({prof['launches_modeled']} launches in the program). A "
             f"kernel's latency t_0 = {c['min_kernel_seconds'] * 1e6:.2f} us and its bytes' share of HBM bandwidth "
             f"e_bw = {c['bandwidth_efficiency']:.3f} are fitted kernel by kernel on the H200's GPT-2-small profiles "
             "(`kernel-bandwidth.md`), not here.", "", "Our step (GEMM and attention fitted exactly, one number each; "
             "the other kinds are the latency and share of `kernel-bandwidth.md`):", ""]
    lines += _kind_table(result["kinds"])
    lines += ["", "The hand-written step, not fitted on:", ""] + _kind_table(result["hand_kinds"])
    lines += ["", "The profiles count cuDNN's `compute_dot_do_o` helper as a GEMM and its dq conversion as attention.",
              "", "Steps the model was not fitted on:", "",
              "| step | measured ms | modeled ms | model / measured | how measured |", "|---|---|---|---|---|"]
    for s in result["steps"]:
        lines.append(f"| {s['step']} | {s['measured'] * 1e3:.2f} | {s['modeled'] * 1e3:.2f} | "
                     f"{s['modeled'] / s['measured']:.2f} | {s['note']} |")
    b2b = f", back to back {r['measured_back_to_back']:.3f}" if r.get("measured_back_to_back") else ""
    lines += ["", f"Ours / hand-written: modeled **{r['modeled']:.3f}**; measured {r['measured_alternating']:.3f} "
              f"alternating{b2b}, {r['profiles_wall']:.3f} by the profiles' wall time and {r['profiles_busy']:.3f} by "
              f"their device-busy time; the model is {100 * (r['modeled'] / r['measured_alternating'] - 1):+.1f}% "
              "off the alternating ratio."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
    sys.exit(0)
