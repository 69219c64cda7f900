"""Cost of the numerics doctor against the plain train step, on the GPT-2-small shape at several depths.

The doctor runs a separate program: the train step's forward and backward with
every op probed (each result measured, each half-precision op computed again in
float32), cut into segments, one per layer and pass, that share compiled programs
where layers repeat; and a float32 run of the same step, its gradients the
reference for underflow. For each depth this times, in one process, the plain
jitted ``train.make_train_step`` (compile, then the median of ``--steps`` steps)
and one diagnosis of the same state and batch (``train.diagnose_state``,
``verify=False``), and reads the peak memory of each: the plain step's from XLA's
memory analysis of its compiled program (arguments, outputs and temporaries), the
doctor's as it ran (live values plus the running segment's temporaries). The
train step is never changed by the doctor (``tests/test_diagnose_training.py``
compares its HLO).

    python -m benchmarks.diagnose_cost [--layers 2 12 24 --d-model 768 --heads 12 --vocab 50257 --seq 128 --batch 4]

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
    p.add_argument("--layers", type=int, nargs="+", default=[2, 12, 24])
    p.add_argument("--d-model", type=int, default=768)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--vocab", type=int, default=50257)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--policy", default="mixed_f16")
    p.add_argument("--steps", type=int, default=10, help="timed plain steps (median)")
    p.add_argument("--out", help="results directory (default: benchmarks/results)")
    return p


def _compiled_peak(compiled) -> int:
    """A compiled program's peak bytes by XLA's memory analysis: arguments, outputs, temporaries."""
    m = compiled.memory_analysis()
    return int(m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes)


def measure(args: argparse.Namespace, layers: int) -> dict:
    """At ``layers`` layers: the plain step's compile and step seconds and peak bytes; the
    diagnosis's seconds (in all, and the probed program's trace, compile, run) and peak bytes."""
    model = GPT(vocab_size=args.vocab, block_size=args.seq, num_layers=layers, num_heads=args.heads,
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
    cost = diagnosis.findings.seconds
    plain = plain_compile + statistics.median(times)
    params = sum(x.size for x in jax.tree_util.tree_leaves(state.params))
    return {"layers": layers, "params": int(params),
            "plain_compile_s": plain_compile, "plain_step_s": statistics.median(times),
            "plain_peak_bytes": _compiled_peak(compiled),
            "doctor_total_s": total, "doctor_probe_trace_s": cost["trace"], "doctor_probe_compile_s": cost["compile"],
            "doctor_probe_run_s": cost["run"], "doctor_peak_bytes": int(cost["peak_bytes"]),
            "segments": int(cost["segments"]), "segments_compiled": int(cost["compiled"]),
            "ratio": total / plain, "healthy": diagnosis.healthy}


def table(result: dict) -> str:
    rows = [("layers", "params", "plain: compile + step", "doctor: total (probe trace / compile / run)",
             "ratio", "segments (compiled)", "peak: plain / doctor")]
    for r in result["depths"]:
        rows.append((str(r["layers"]), f"{r['params'] / 1e6:.0f}M",
                     f"{r['plain_compile_s']:.1f} + {r['plain_step_s']:.2f} s",
                     f"{r['doctor_total_s']:.1f} s ({r['doctor_probe_trace_s']:.1f} / {r['doctor_probe_compile_s']:.1f}"
                     f" / {r['doctor_probe_run_s']:.1f})",
                     f"{r['ratio']:.1f}x", f"{r['segments']} ({r['segments_compiled']})",
                     f"{r['plain_peak_bytes'] / 2**30:.2f} / {r['doctor_peak_bytes'] / 2**30:.2f} GiB"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    shape = result["shape"]
    head = (f"GPT, d_model {shape['d_model']}, {shape['heads']} heads, vocab {shape['vocab']}, batch {shape['batch']} x "
            f"{shape['seq']} tokens, {result['policy']}, {result['device']}, jax {result['jax']}; ratio: the whole "
            f"diagnosis (verify=False) over the plain step's compile + one step")
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(row, widths)) + " |" for row in rows]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join([head, "", *lines])


def main(argv: list[str] | None = None) -> dict:
    args = _parser().parse_args(argv)
    result = {"shape": {k: getattr(args, k) for k in ("d_model", "heads", "vocab", "seq", "batch")},
              "policy": args.policy, "device": jax.devices()[0].device_kind, "jax": jax.__version__,
              "python": platform.python_version(), "depths": []}
    for layers in args.layers:
        result["depths"].append(measure(args, layers))
        print(f"{layers} layers: {json.dumps(result['depths'][-1])}", flush=True)
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
