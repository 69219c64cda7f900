"""Accuracy parity: the shipped configs trained in fp32, mixed_bf16 and mixed_f16.

Each experiment (Fashion-MNIST ResNet, Shakespeare character GPT) runs its three
``configs/<experiment>_<policy>.yaml`` with the same seed, data order and step
budget, through the CLI exactly as a user would. Then it reports final test
accuracy and validation loss against fp32 (goals: within 0.5 percentage points
and 2%), the loss-scale history and skipped steps, half-precision inference of
the fp32-trained model, and plots the curves.

    python -m benchmarks.parity [--steps 1000] [--runs runs/parity] [--report-only] [--out DIR] [--docs DIR]

Writes ``benchmarks/results/parity.{json,md}`` and ``docs/parity_<experiment>.png``.
A run whose ``summary.json`` already shows the budget is not repeated.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
from typing import Any

from benchmarks.report import RESULTS, environment, pyplot
from train.tracking.metrics import read_metrics

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
EXPERIMENTS = ("fmnist_resnet", "shakespeare_gpt")
POLICIES = ("fp32", "mixed_bf16", "mixed_f16")
GOALS = {"accuracy_pp": 0.5, "val_loss_relative": 0.02}


def run_overrides(steps: int) -> list[str]:
    """The CLI overrides every parity run gets: the budget and how often to log."""
    return [f"steps={steps}", "log_every=50", f"eval_every={max(steps // 4, 1)}"]


def train_all(runs: pathlib.Path, steps: int, experiments=EXPERIMENTS) -> None:
    """Trains every experiment under every policy (one CLI process each), skipping finished runs."""
    for experiment in experiments:
        for policy in POLICIES:
            name = f"{experiment}_{policy}"
            workdir = runs / name
            summary = workdir / "summary.json"
            if summary.exists() and json.loads(summary.read_text())["steps"] == steps:
                print(f"{name}: done already ({summary})", flush=True)
                continue
            cmd = [sys.executable, "-m", "train", str(ROOT / "configs" / f"{name}.yaml"), f"workdir={workdir}",
                   *run_overrides(steps)]
            print("$ " + " ".join(cmd), flush=True)
            subprocess.run(cmd, check=True, cwd=ROOT)


def collect(runs: pathlib.Path, experiments=EXPERIMENTS) -> dict[str, dict[str, Any]]:
    """The summary and metrics records of every finished run, by experiment and policy."""
    out: dict[str, dict[str, Any]] = {}
    for experiment in experiments:
        for policy in POLICIES:
            workdir = runs / f"{experiment}_{policy}"
            if not (workdir / "summary.json").exists():
                raise FileNotFoundError(f"{workdir}/summary.json: run `python -m benchmarks.parity` to train it")
            records = read_metrics(str(workdir))
            out.setdefault(experiment, {})[policy] = {
                "summary": json.loads((workdir / "summary.json").read_text()), "records": records}
    return out


def compare(runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Final accuracy and validation loss per policy against fp32, with the goals checked."""
    table: dict[str, Any] = {}
    for experiment, by_policy in runs.items():
        base = by_policy["fp32"]["summary"]["eval"]
        rows = {}
        for policy, run in by_policy.items():
            s = run["summary"]
            ev = s["eval"]
            acc_pp = 100 * (ev["accuracy"] - base["accuracy"])
            loss_rel = ev["loss"] / base["loss"] - 1
            rows[policy] = {
                "accuracy": ev["accuracy"], "val_loss": ev["loss"], "perplexity": ev.get("perplexity"),
                "accuracy_delta_pp": acc_pp, "val_loss_delta_relative": loss_rel,
                "within_goals": abs(acc_pp) <= GOALS["accuracy_pp"] and abs(loss_rel) <= GOALS["val_loss_relative"],
                "loss_scale": s["loss_scale"], "steps": s["steps"], "train_seconds": s["train_seconds"],
                "steps_per_sec": s["steps_per_sec"], "policy": s["policy"],
                "loss_scale_history": [(r["step"], r["loss_scale"]) for r in run["records"] if r["kind"] == "train"],
                "inference": s["inference"],
            }
        table[experiment] = rows
    return table


def budget(runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """What each experiment cost: steps, batch, tokens or examples, wall time."""
    out = {}
    for experiment, by_policy in runs.items():
        cfg = _config(by_policy["fp32"]["summary"]["workdir"])
        language_model = "perplexity" in by_policy["fp32"]["summary"]["eval"]
        out[experiment] = {"steps": cfg["steps"], "batch_size": cfg["data"]["batch_size"],
                           "seed": cfg["seed"], "seq_len": cfg["data"].get("seq_len") if language_model else None,
                           "train_minutes": {p: r["summary"]["train_seconds"] / 60 for p, r in by_policy.items()}}
    return out


def _config(workdir: str) -> dict:
    import yaml
    return yaml.safe_load(pathlib.Path(workdir, "config.yaml").read_text())


def plot(runs: dict[str, dict[str, Any]], directory: pathlib.Path = DOCS) -> list[pathlib.Path]:
    """One PNG per experiment: train loss, validation loss and accuracy, loss scale, per
    policy (none without matplotlib)."""
    plt = pyplot()
    if plt is None:
        return []

    paths = []
    for experiment, by_policy in runs.items():
        fig, axes = plt.subplots(1, 4, figsize=(18, 4))
        for policy, run in by_policy.items():
            style = dict(linestyle="--", linewidth=3, alpha=0.5) if policy == "fp32" else {}
            train = [r for r in run["records"] if r["kind"] == "train"]
            evals = [r for r in run["records"] if r["kind"] == "eval"]
            axes[0].plot([r["step"] for r in train], [r["loss"] for r in train], label=policy, **style)
            axes[1].plot([r["step"] for r in evals], [r["loss"] for r in evals], marker="o", label=policy, **style)
            axes[2].plot([r["step"] for r in evals], [100 * r["accuracy"] for r in evals], marker="o", label=policy,
                         **style)
            axes[3].plot([r["step"] for r in train], [r["loss_scale"] for r in train], label=policy, **style)
        for ax, title in zip(axes, ("train loss", "validation loss", "validation accuracy (%)", "loss scale")):
            ax.set_title(title)
            ax.set_xlabel("step")
            ax.grid(alpha=0.3)
            ax.legend()
        axes[3].set_yscale("log", base=2)
        fig.suptitle(f"{experiment}: fp32 vs mixed precision (same seed, data order and budget)")
        fig.tight_layout()
        path = directory / f"parity_{experiment}.png"
        fig.savefig(path, dpi=80)
        plt.close(fig)
        paths.append(path)
    return paths


def markdown(result: dict[str, Any]) -> str:
    """The parity tables: accuracy and loss vs fp32, loss scale, inference, budget."""
    env = result["environment"]
    out = [f"# Accuracy parity ({env['date']}, {env['device']}, jax {env['jax']})", "",
           f"Reproduce: `{result['command']}`. Every run: the shipped config with "
           f"`{' '.join(result['overrides'])}` (same seed and data order across policies).", ""]
    for experiment, rows in result["table"].items():
        b = result["budget"][experiment]
        tokens = f" x {b['seq_len']} tokens" if b["seq_len"] else ""
        out += [f"## {experiment}", "",
                f"Budget: {b['steps']} steps at batch {b['batch_size']}{tokens}, seed {b['seed']}, on "
                f"{env['cpu_count']} CPU cores: "
                + ", ".join(f"{p} {m:.1f} min" for p, m in b["train_minutes"].items()) + ".", "",
                "| policy | test accuracy | vs fp32 (pp) | validation loss | vs fp32 | within goals | loss scale "
                "(initial -> final, decreases) | skipped steps |", "|---|---|---|---|---|---|---|---|"]
        for policy, r in rows.items():
            ls = r["loss_scale"]
            out.append(f"| {policy} | {100 * r['accuracy']:.2f}% | {r['accuracy_delta_pp']:+.2f} | {r['val_loss']:.4f} "
                       f"| {100 * r['val_loss_delta_relative']:+.2f}% | {'yes' if r['within_goals'] else 'NO'} "
                       f"| {ls['initial']:g} -> {ls['final']:g}, {ls['decreases']} | {ls['skipped_steps']} |")
        inf = rows["fp32"]["inference"]
        out += ["", "Half-precision inference of the fp32-trained model (params and compute in the dtype, "
                "norms in float32):", "", "| served in | accuracy | vs float32 (pp) | loss |", "|---|---|---|---|"]
        for dtype, m in inf.items():
            out.append(f"| {dtype} | {100 * m['accuracy']:.2f}% | {100 * m.get('accuracy_delta', 0.0):+.2f} "
                       f"| {m['loss']:.4f} |")
        out += ["", f"![{experiment}](../../docs/parity_{experiment}.png)", ""]
    out.append(f"Goals: mixed policies within {GOALS['accuracy_pp']} percentage points of fp32 accuracy and "
               f"{100 * GOALS['val_loss_relative']:.0f}% of its validation loss.")
    return "\n".join(out) + "\n"


def parser() -> argparse.ArgumentParser:
    """The command line of ``python -m benchmarks.parity``."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.parity", description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=1000, help="training steps per run (default 1000)")
    p.add_argument("--runs", default=str(ROOT / "runs" / "parity"), help="where the runs' workdirs go")
    p.add_argument("--report-only", action="store_true", help="only report runs already trained")
    p.add_argument("--out", default=str(RESULTS), help="where the tables go")
    p.add_argument("--docs", default=str(DOCS), help="where the plots go")
    return p


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parser().parse_args(argv)
    runs_dir = pathlib.Path(args.runs)
    if not args.report_only:
        train_all(runs_dir, args.steps)
    runs = collect(runs_dir)
    result = {"environment": environment(), "overrides": run_overrides(args.steps),
              "command": "python -m benchmarks.parity" + (f" --steps {args.steps}" if args.steps != 1000 else ""),
              "table": compare(runs), "budget": budget(runs)}
    pathlib.Path(args.docs).mkdir(parents=True, exist_ok=True)
    result["plots"] = [os.path.relpath(path, ROOT) for path in plot(runs, pathlib.Path(args.docs))]
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "parity.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / "parity.md").write_text(markdown(result))
    print(markdown(result))
    summary = {f"{e}_{p}": {"accuracy_delta_pp": round(r["accuracy_delta_pp"], 3),
                            "val_loss_delta_relative": round(r["val_loss_delta_relative"], 4)}
               for e, rows in result["table"].items() for p, r in rows.items() if p != "fp32"}
    print(json.dumps(summary))
    return result


if __name__ == "__main__":
    main()
