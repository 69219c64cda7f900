"""Cost of the numerics doctor against the plain train step, on the GPT-2-small shape.

The doctor runs a separate program: the train step's forward and backward with
every op probed (each result measured, each half-precision op computed again in
float32). This times, in one process, the plain jitted ``train.make_train_step``
(compile, then the median of ``--steps`` steps) and one diagnosis of the same
state and batch (``train.diagnose_state``, ``verify=False``: trace, compile and
run of the probed program). The train step is never changed by the doctor
(``tests/test_diagnose_training.py`` compares its HLO).

    python -m benchmarks.diagnose_cost [--layers 12 --d-model 768 --heads 12 --vocab 50257 --seq 128 --batch 4]

Prints a table and writes ``benchmarks/results/diagnose_cost-<device>.{md,json}``
(``--out DIR`` for elsewhere).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import platform
import statistics
import time

import jax
import optax

import train
from train.models import GPT

RESULTS = pathlib.Path(__file__).parent / "results"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.diagnose_cost", description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--d-model", type=int, default=768)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--vocab", type=int, default=50257)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--policy", default="mixed_f16")
    p.add_argument("--steps", type=int, default=10, help="timed plain steps (median)")
    p.add_argument("--out", help="results directory (default: benchmarks/results)")
    return p


def measure(args: argparse.Namespace) -> dict:
    """The plain step's compile and step seconds, and the diagnosis's trace, compile and run seconds."""
    model = GPT(vocab_size=args.vocab, block_size=args.seq, num_layers=args.layers, num_heads=args.heads,
                d_model=args.d_model)
    tokens = jax.random.randint(jax.random.key(0), (args.batch, args.seq + 1), 0, args.vocab)
    batch = {"inputs": tokens[:, :-1], "labels": tokens[:, 1:]}
    state = train.create_train_state(model, args.policy, optax.adamw(1e-4), jax.random.PRNGKey(0),
                                     batch["inputs"][:1])
    task = train.get_task("language_model")
    step = train.make_train_step(task=task, donate=False)
    start = time.perf_counter()
    compiled = step.lower(state, batch).compile()
    plain_compile = time.perf_counter() - start
    jax.block_until_ready(compiled(state, batch))
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        jax.block_until_ready(compiled(state, batch))
        times.append(time.perf_counter() - start)
    start = time.perf_counter()
    diagnosis = train.diagnose_state(state, batch, task, verify=False)
    total = time.perf_counter() - start
    seconds = diagnosis.findings.seconds
    params = sum(x.size for x in jax.tree_util.tree_leaves(state.params))
    return {"shape": {k: getattr(args, k) for k in ("layers", "d_model", "heads", "vocab", "seq", "batch")},
            "params": int(params), "policy": args.policy, "device": jax.devices()[0].device_kind,
            "plain_compile_s": plain_compile, "plain_step_s": statistics.median(times),
            "doctor_trace_s": seconds["trace"], "doctor_compile_s": seconds["compile"],
            "doctor_run_s": seconds["run"], "doctor_total_s": total,
            "run_ratio": seconds["run"] / statistics.median(times),
            "compile_ratio": seconds["compile"] / plain_compile,
            "healthy": diagnosis.healthy, "jax": jax.__version__, "python": platform.python_version()}


def table(r: dict) -> str:
    rows = [("", "plain train step", "instrumented (doctor)", "ratio"),
            ("compile", f"{r['plain_compile_s']:.1f} s", f"{r['doctor_compile_s']:.1f} s", f"{r['compile_ratio']:.1f}x"),
            ("one step", f"{r['plain_step_s']:.2f} s", f"{r['doctor_run_s']:.2f} s", f"{r['run_ratio']:.1f}x")]
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    shape = r["shape"]
    head = (f"GPT {shape['layers']} layers, d_model {shape['d_model']}, {shape['heads']} heads, vocab {shape['vocab']}, "
            f"batch {shape['batch']} x {shape['seq']} tokens ({r['params'] / 1e6:.0f}M params), {r['policy']}, "
            f"{r['device']}; doctor trace {r['doctor_trace_s']:.1f} s, total {r['doctor_total_s']:.1f} s")
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(row, widths)) + " |" for row in rows]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join([head, "", *lines])


def main(argv: list[str] | None = None) -> dict:
    args = _parser().parse_args(argv)
    result = measure(args)
    text = table(result)
    print(text)
    out = pathlib.Path(args.out) if args.out else RESULTS
    out.mkdir(parents=True, exist_ok=True)
    name = f"diagnose_cost-{jax.default_backend()}"
    (out / f"{name}.md").write_text(text + "\n")
    (out / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"written to {out / name}.{{md,json}}")
    return result


if __name__ == "__main__":
    main()
