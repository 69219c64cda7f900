"""Benchmark results as a printed table, markdown and JSON under ``benchmarks/results/``."""

from __future__ import annotations

import datetime
import json
import os
import pathlib
import platform
import re
import sys
from typing import Any

import flax
import jax
import optax

from benchmarks.workloads import MODEL_FLOPS_FORMULA

#: The committed tables (full sizes, or ``--out benchmarks/results``).
RESULTS = pathlib.Path(__file__).parent / "results"
#: Where a quick run writes unless told otherwise: never over the committed tables.
SCRATCH = pathlib.Path(__file__).resolve().parent.parent / "runs" / "benchmarks"

GOALS = {"overhead_ratio": 1.03, "loss_scale_overhead_ratio": 1.05, "memory_ratio": 0.6}


def environment() -> dict[str, Any]:
    """Where and when the numbers were taken."""
    device = jax.devices()[0]
    return {
        "device": device.device_kind if device.platform != "cpu" else f"cpu ({platform.processor() or platform.machine()})",
        "platform": device.platform, "device_count": jax.device_count(), "cpu_count": os.cpu_count(),
        "jax": jax.__version__, "jaxlib": getattr(jax.lib, "__version__", None) or _jaxlib_version(),
        "flax": flax.__version__, "optax": optax.__version__, "python": platform.python_version(),
        "date": datetime.date.today().isoformat(),
    }


def _jaxlib_version() -> str | None:
    try:
        import jaxlib
        return jaxlib.__version__
    except (ImportError, AttributeError):
        return None


def device_slug(env: dict[str, Any]) -> str:
    """``cpu`` or the accelerator's name as a file name (``nvidia-h100-80gb-hbm3``)."""
    if env["platform"] == "cpu":
        return "cpu"
    return re.sub(r"[^a-z0-9]+", "-", env["device"].lower()).strip("-")


def _mib(n: float | None) -> str:
    return "-" if n is None else f"{n / 2 ** 20:.1f}"


def _x(v: float | None, digits: int = 2) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def _pct(v: float | None) -> str:
    return "-" if v is None or v != v else f"{100 * v:.0f}%"


def table(results: dict[str, Any]) -> str:
    """The per-model, per-policy table in markdown."""
    head = ("| model | policy | step ms | back-to-back step ms | fwd ms | bwd+update ms | throughput/s | speedup vs fp32 "
            "| activations MiB (vs fp32) | XLA memory MiB: args / out / temp / total | XLA GFLOP "
            "| half matmul share: program / compiled | MFU | MFU (6N + 12LdT, back to back) | modeled step ms |")
    lines = [head, "|" + "---|" * head.count(" | ") + "---|"]
    for r in results["rows"]:
        m = r["memory"]
        lines.append(
            f"| {r['model']} | {r['policy']} | {r['step_seconds'] * 1e3:.2f} "
            f"| {_ms(r.get('step_seconds_back_to_back'))} | {r['forward_seconds'] * 1e3:.2f} "
            f"| {r['backward_seconds'] * 1e3:.2f} | {r['items_per_second']:,.0f} {r['items']} "
            f"| {_x(r['speedup_vs_fp32'])}x | {_mib(r['activations']['bytes'])} ({_x(r['activations_vs_fp32'])}x) "
            f"| {_mib(m.get('arguments'))} / {_mib(m.get('outputs'))} / {_mib(m.get('temps'))} / "
            f"{_mib(m.get('total'))} | {_x((r['xla_flops'] or 0) / 1e9, 1)} "
            f"| {_pct(r['half_matmul_share_program'])} / {_pct(r['half_matmul_share_compiled'])} "
            f"| {_pct(r['mfu'])} | {_pct(r.get('mfu_model_flops'))} | {_modeled_ms(r.get('modeled'))} |")
    return "\n".join(lines)


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.2f}"


def _modeled_ms(modeled: dict[str, Any] | None) -> str:
    if not modeled:
        return "-"
    return "(model failed)" if "error" in modeled else f"{modeled['seconds'] * 1e3:.2f}"


def pinned_table(results: dict[str, Any]) -> str:
    """Each pinned-dtype model next to its unpinned twin: half share, step time, compiled cost."""
    rows = {(r["model"], r["policy"]): r for r in results["rows"]}
    head = ("| model | policy | half matmul share: unpinned / pinned | step ms: unpinned / pinned "
            "| pinned / unpinned: XLA FLOPs, bytes accessed |")
    lines = [head, "|---|---|---|---|---|"]
    for r in results["rows"]:
        twin = rows.get((r["model"].removesuffix("_pinned"), r["policy"]))
        if not r["model"].endswith("_pinned") or twin is None:
            continue
        lines.append(f"| {twin['model']} | {r['policy']} | {_pct(twin['half_matmul_share_program'])} / "
                     f"{_pct(r['half_matmul_share_program'])} | {twin['step_seconds'] * 1e3:.2f} / "
                     f"{r['step_seconds'] * 1e3:.2f} | {_x(r['pinned_flops_vs_unpinned'], 3)}, "
                     f"{_x(r['pinned_bytes_vs_unpinned'], 3)} |")
    return "\n".join(lines) if len(lines) > 2 else ""


def _overhead_times(o: dict[str, Any]) -> str:
    if "ours_seconds" not in o:
        return ""
    text = f" [alternating: ours {o['ours_seconds'] * 1e3:.2f} ms, hand-written {o['hand_written_seconds'] * 1e3:.2f} ms"
    if "back_to_back_ratio" in o:
        text += (f"; each on its own, back to back {o['ours_back_to_back_seconds'] * 1e3:.2f} / "
                 f"{o['hand_written_back_to_back_seconds'] * 1e3:.2f} ms = {o['back_to_back_ratio']:.3f}, waited "
                 f"{o['ours_waited_seconds'] * 1e3:.2f} / {o['hand_written_waited_seconds'] * 1e3:.2f} ms "
                 f"= {o['waited_ratio']:.3f}")
    ours, hand = o.get("ours_modeled"), o.get("hand_written_modeled")
    if ours and hand and "error" not in ours and "error" not in hand:
        text += (f"; modeled {ours['seconds'] * 1e3:.2f} / {hand['seconds'] * 1e3:.2f} ms, "
                 f"{ours['launches']} / {hand['launches']} kernel launches")
    return text + "]"


def headline(results: dict[str, Any]) -> dict[str, float]:
    """The three ratios the suite is judged by."""
    return {k: round(results[k], 4) for k in GOALS}


def markdown(results: dict[str, Any]) -> str:
    """The whole report: environment, table, headline ratios with their goals and details."""
    env, s = results["environment"], results["settings"]
    out = [f"# Benchmarks on {env['device']} ({s['size']} sizes)", "",
           f"{env['date']}; jax {env['jax']}, flax {env['flax']}, optax {env['optax']}, Python {env['python']}; "
           f"{env['device_count']} {env['platform']} device(s), {env['cpu_count']} CPU cores. "
           f"Reproduce: `{results['command']}` ({results['wall_seconds']:.0f} s).", "",
           f"Medians over {s['steps']} steps after {s['warmup']} warm-up steps; ratios are medians over "
           f"{s['rounds']} alternating rounds of {s['steps_per_round']} steps. Optimizer AdamW.",
           "", "## Headline ratios", "", "| ratio | value | goal |", "|---|---|---|"]
    for k, goal in GOALS.items():
        out.append(f"| `{k}` | {results[k]:.3f} | <= {goal} |")
    out += ["", "- `overhead_ratio`: our `train.make_train_step` / a hand-written JAX + optax step with the same "
            "model, bf16 casts and AdamW, per model: "
            + ", ".join(f"{o['model']} {o['ratio']:.3f} (first-step loss difference {o['first_step_loss_difference']:.1e})"
                        + (f" (the programs of {o['same_programs_as']}: not timed again)" if o.get("same_programs_as")
                           else "") + _overhead_times(o) for o in results["overhead"]) + "; the worst is reported.",
            "- `loss_scale_overhead_ratio`: mixed_f16 with dynamic loss scaling / mixed_f16 without, per model: "
            + ", ".join(f"{o['model']} {o['ratio']:.3f}" for o in results["loss_scale_overhead"])
            + "; the worst is reported.",
            f"- `memory_ratio`: activation bytes saved for the backward pass by the GPT at batch "
            f"{results['memory']['batch']} x {results['memory']['seq_len']} tokens, mixed_bf16 / fp32: "
            f"{_mib(results['memory']['mixed_bf16']['bytes'])} / {_mib(results['memory']['fp32']['bytes'])} MiB "
            f"= {results['memory']['ratio']:.3f}; with the shipped config's float32 softmax "
            f"{results['memory']['ratio_f32_softmax']:.3f}. From the traced program "
            f"(JAX's `saved_residuals`, what `jax.ad_checkpoint.print_saved_residuals` prints), so the same "
            f"on every backend.",
            "", "## Per model and policy", "", table(results), "",
            "Models: " + "; ".join(f"`{k}`: {v}" for k, v in results["models"].items()) + ".", "",
            "Columns: *step* is the median of steps each waited for; *back-to-back step* the time per step "
            "of steps run back to back and waited for once (as a training loop runs them: each step's "
            "dispatch overlaps the device's work on the one before). *fwd* is the forward pass and float32 loss alone; *bwd+update* the rest of the step. "
            "*Activations*: residuals saved for the backward pass, without the params and their "
            "compute-dtype copies. *XLA memory*: `compiled.memory_analysis()` of the train step (total = "
            "args + out + temp - donated). *Half matmul share*: the share of dot/convolution FLOPs with half "
            "inputs, in the program as written and after XLA compiled it. *MFU*: matmul FLOPs of the program "
            "per second over the device's dense peak for the precision the matmuls run in (GPU only). "
            "*MFU (6N + 12LdT, back to back)*: the FLOPs of the usual formula per back-to-back step "
            "over the same peak, "
            f"{MODEL_FLOPS_FORMULA} (GPT models only). *Modeled step*: "
            "`train.inspections.gpu_time`'s time for the compiled program (a model, not a measurement)."]
    pinned = pinned_table(results)
    if pinned:
        out += ["", "## Models with pinned layer dtypes", "",
                "Each `_pinned` model is its twin with `dtype=jnp.float32` on every layer, as Flax's examples "
                "write models. The policy reaches it through `precision.autocast`; the compiled step should "
                "match the unpinned one (XLA FLOPs and bytes accessed from `compiled.cost_analysis()`).", "",
                pinned]
    if env["platform"] == "cpu":
        out += ["", "On CPU only ratios mean anything, and half precision is not faster: XLA's CPU backend "
                "widens bfloat16/float16 dots to float32 (compiled half share 0%) and adds the conversions, "
                "and its memory plan barely moves with precision. The activation bytes are the "
                "backend-independent memory measure."]
    return "\n".join(out) + "\n"


def pyplot() -> Any:
    """``matplotlib.pyplot`` (off-screen), or ``None`` with a note when it is not
    installed: the tables do not need it, only the plots (``pip install -e ".[bench]"``)."""
    try:
        import matplotlib
    except ImportError:
        print('plots skipped: matplotlib is not installed (pip install -e ".[bench]")', flush=True)
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def results_dir(out: str | None, size: str) -> pathlib.Path:
    """Where a suite run of ``size`` writes: ``out`` when given, else the committed
    tables for full sizes and a scratch directory for quick ones."""
    return pathlib.Path(out) if out else SCRATCH if size == "quick" else RESULTS


def save(results: dict[str, Any], directory: pathlib.Path = RESULTS) -> tuple[pathlib.Path, pathlib.Path]:
    """Writes ``<device>[-quick].json`` and ``.md``; returns their paths."""
    directory.mkdir(parents=True, exist_ok=True)
    stem = device_slug(results["environment"]) + ("-quick" if results["settings"]["size"] == "quick" else "")
    json_path, md_path = directory / f"{stem}.json", directory / f"{stem}.md"
    json_path.write_text(json.dumps(results, indent=1, default=float) + "\n")
    md_path.write_text(markdown(results))
    return json_path, md_path


def command(module: str, argv: list[str] | None) -> str:
    """The command that reproduces a benchmark's run: ``python -m MODULE`` and its arguments
    (``argv`` as given to ``main``, else the process's)."""
    return " ".join(["python", "-m", module, *(argv if argv is not None else sys.argv[1:])])


def write_tables(out: str | pathlib.Path, stem: str, result: dict[str, Any], text: str) -> tuple[pathlib.Path, pathlib.Path]:
    """Writes ``<out>/<stem>.json`` (``result``) and ``.md`` (``text``), prints ``text``; returns the paths."""
    out = pathlib.Path(out)
    out.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out / f"{stem}.json", out / f"{stem}.md"
    json_path.write_text(json.dumps(result, indent=2, default=float) + "\n")
    md_path.write_text(text)
    print(text)
    return json_path, md_path

