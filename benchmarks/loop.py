"""``python -m benchmarks.loop [CONFIG] [key=value ...]``: does the training loop
keep the device busy?

Runs the experiment ``CONFIG`` (default ``configs/default.yaml``) through
:func:`train.run` (data pipeline, prefetch, metrics, logging, progress,
checkpoints: everything ``python -m train`` does) and, in the same process,
the bare jitted ``train_step`` of the same model, policy and optimizer on one
batch already on the device, one call per step. Loop efficiency is the loop's
steps/s (after its first, compiling step, as its summary reports) over the bare
step's: 1.0 means the loop adds nothing to the step; above 1 when the config's
``steps_per_call`` saves the per-call launch the bare loop pays every step. Prints a table and writes
``benchmarks/results/loop_<device>.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import tempfile
import time

import jax

import train
from benchmarks import report
from train.experiment.builders import build_train_state
from train.experiment.loop import build_experiment

DEFAULT_CONFIG = pathlib.Path(__file__).resolve().parents[1] / "configs" / "default.yaml"
QUIET = ["progress=false", "inference_dtypes=[]", "eval_every=0"]


def bare_steps_per_second(config: train.ExperimentConfig, steps: int, repeats: int = 3) -> float:
    """Steps/s of the jitted train step alone (built as the loop builds it: same
    layout, policy, loss scale) on one device-resident batch (median of ``repeats``)."""
    data, task, model = build_experiment(config)
    layout = train.Layout(train.make_mesh(config.mesh.data, config.mesh.fsdp), config.mesh.fsdp_min_size)
    state, schedule = build_train_state(config, model, data, layout)
    step = train.make_train_step(accum_steps=config.accum_steps, learning_rate_fn=schedule, layout=layout,
                                 task=task)
    size = config.data.batch_size * config.accum_steps
    batch = layout.global_batch(data.train_batch(0, size, config.seed), size)
    state, metrics = step(state, batch)  # compile
    jax.block_until_ready(metrics)
    rates = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(steps):
            state, metrics = step(state, batch)
        jax.block_until_ready((state, metrics))
        rates.append(steps / (time.perf_counter() - start))
    return statistics.median(rates)


def loop_steps_per_second(config_path: str | os.PathLike, overrides: list[str], steps: int
                          ) -> tuple[float, dict]:
    """Steps/s of :func:`train.run` after its first step (as its summary reports), and the summary."""
    with tempfile.TemporaryDirectory() as workdir:
        settings = QUIET + [f"steps={steps}", f"workdir={workdir}", f"checkpoint_every={steps}",
                            f"log_every={min(50, steps)}"] + list(overrides)
        summary = train.run(train.load_config(config_path, settings), out=open(os.devnull, "w"))
    return summary["steps_per_sec"], summary


def measure(config_path: str | os.PathLike, overrides: list[str], steps: int, rounds: int = 3) -> dict:
    """The loop's and the bare step's steps/s for one config (medians over ``rounds``
    alternating runs of each, as the machine's load drifts), and their ratio."""
    loop, bare = [], []
    for _ in range(rounds):
        rate, summary = loop_steps_per_second(config_path, overrides, steps)
        loop.append(rate)
        config = train.load_config(config_path, list(overrides))
        bare.append(bare_steps_per_second(config, steps, repeats=1))
    loop_rate, bare_rate = statistics.median(loop), statistics.median(bare)
    return {"config": str(config_path), "overrides": list(overrides), "steps": steps, "rounds": rounds,
            "loop_steps_per_sec": loop_rate, "bare_steps_per_sec": bare_rate, "efficiency": loop_rate / bare_rate,
            "loop_runs": loop, "bare_runs": bare, "tokens_per_sec": summary.get("tokens_per_sec"),
            "policy": summary["policy_spec"], "model": summary["model"],
            "steps_per_call": train.load_config(config_path, list(overrides)).steps_per_call}


def table(rows: list[dict]) -> str:
    """A markdown table of :func:`measure` results."""
    lines = ["| config | policy | steps per call | loop steps/s | bare step steps/s | efficiency |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        name = pathlib.Path(r["config"]).name + "".join(f" {o}" for o in r["overrides"])
        lines.append(f"| {name} | {r['policy']} | {r['steps_per_call']} | {r['loop_steps_per_sec']:.1f} | "
                     f"{r['bare_steps_per_sec']:.1f} | "
                     f"{r['efficiency']:.3f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.loop", description=__doc__.split("\n\n")[0])
    parser.add_argument("args", nargs="*", metavar="[CONFIG] key=value",
                        help=f"experiment YAML (default {DEFAULT_CONFIG.name}) and overrides")
    parser.add_argument("--steps", type=int, default=300, help="loop steps (and bare steps) per round")
    parser.add_argument("--rounds", type=int, default=3, help="alternating loop / bare rounds (medians)")
    parser.add_argument("--out", default=str(report.RESULTS), help="results directory")
    args = parser.parse_intermixed_args(argv)
    config, overrides = str(DEFAULT_CONFIG), list(args.args)
    if overrides and "=" not in overrides[0]:
        config = overrides.pop(0)
    rows = [measure(config, overrides, args.steps, args.rounds)]
    text = table(rows)
    print(text)
    device = jax.devices()[0].device_kind.lower().replace(" ", "_")
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    payload = {"environment": report.environment(), "results": rows}
    (out / f"loop_{device}.json").write_text(json.dumps(payload, indent=2))
    (out / f"loop_{device}.md").write_text(f"{text}\n\nenvironment: {payload['environment']}\n")
    print(json.dumps({"efficiency": rows[0]["efficiency"]}))
    return rows


if __name__ == "__main__":
    main()
