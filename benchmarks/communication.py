"""Bytes a train step sends between devices, per mesh layout and policy.

The project's GPT (2 layers, d_model 256, 4 heads, vocabulary 128, 16 x 64
tokens) on 8 forced CPU devices: data parallel (8, 1), FSDP (1, 8) and both
(2, 4), under fp32, mixed_bf16, mixed_f16 and mixed_fp8 (every matmul but
attention's in FP8: ``min_size`` 0, this GPT being below the default), gradients reduced in float32
(``precision.reduce_dtype`` auto) or in the half dtype (``POLICY:DTYPE``, e.g.
``mixed_bf16:bf16``). Each train step is compiled,
not run, and its collectives read from the program XLA's SPMD partitioner
produces (:func:`train.explain_communication`): what a GPU would send. One
GPU cannot show communication; this runs anywhere.

    python -m benchmarks.communication [--layouts 8x1,1x8,2x4] [--policies fp32,mixed_bf16:bf16] [--out DIR]

Writes ``communication.{json,md}`` to ``--out`` (default ``benchmarks/results``).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
from typing import Any

DEVICES = 8
FLAG = f"--xla_force_host_platform_device_count={DEVICES}"
LAYOUTS = ("8x1", "1x8", "2x4")
POLICIES = ("fp32", "mixed_bf16", "mixed_bf16:bf16", "mixed_f16", "mixed_f16:f16", "mixed_fp8", "mixed_fp8:bf16")
GPT = dict(vocab_size=128, block_size=64, num_layers=2, num_heads=4, d_model=256)
BATCH, SEQ = 16, 64


def measure(layout_name: str, spec: str) -> dict[str, Any]:
    """The collectives of one compiled train step of the GPT on ``layout_name`` (``DATAxFSDP``)
    under ``spec``: a policy, or ``POLICY:REDUCE_DTYPE``."""
    import jax
    import numpy as np
    import optax

    from train import Layout, create_train_state, explain_communication, make_mesh, make_train_step
    from train.models import GPT as Model

    policy, _, reduce_dtype = spec.partition(":")
    data, fsdp = (int(n) for n in layout_name.split("x"))
    layout = Layout(make_mesh(data, fsdp, jax.devices()[:data * fsdp]))
    tokens = np.random.default_rng(0).integers(0, GPT["vocab_size"], (BATCH, SEQ), dtype=np.int32)
    state = create_train_state(Model(**GPT), policy, optax.adam(1e-3), jax.random.PRNGKey(0), tokens[:1],
                               layout=layout, reduce_dtype=reduce_dtype or "auto",
                               fp8={"min_size": 0} if policy == "mixed_fp8" else None)
    step = make_train_step(layout=layout, donate=False, task="language_model")
    report = explain_communication(step, state, layout.global_batch({"inputs": tokens, "labels": tokens}, BATCH))

    def part(carries: str) -> dict[str, Any]:
        chosen = report.select(carries)
        return {"bytes": report.bytes(carries), "sent_bytes": report.sent_bytes(carries),
                "scattered_sent_bytes": report.scattered_sent_bytes(carries), "count": len(chosen), "dtypes": sorted({c.dtype for c in chosen})}

    return {"layout": layout_name, "policy": policy, "reduce_dtype": reduce_dtype or "auto", "stage": report.stage, "params": part("params"),
            "gradients": part("gradients"), "other": {"sent_bytes": report.sent_bytes() - sum(
                report.sent_bytes(k) for k in ("params", "gradients"))}, "sent_bytes": report.sent_bytes()}


def markdown(rows: list[dict[str, Any]], env: dict[str, Any]) -> str:
    """The table: per layout and policy, what the params' gathers and the gradients' reductions send."""
    reference = {r["layout"]: r["sent_bytes"] for r in rows if r["policy"] == "fp32"}
    lines = ["# Communication per train step", "",
             f"The project's GPT ({GPT['num_layers']} layers, d_model {GPT['d_model']}, {BATCH} x {SEQ} tokens) "
             f"on {DEVICES} devices; MiB each device sends per step (ring collectives), from the program after "
             "XLA's SPMD partitioning. `mesh` is data x fsdp. There a split param's gradient is an all-reduce "
             "followed by a slice of each device's part; `as reduce-scatters`: what the gradients would send "
             "were those pairs reduce-scatters (XLA's GPU and TPU compilers can rewrite them so). mixed_fp8 runs "
             "every matmul but attention's in FP8 (min_size 0: this GPT is below the default); the params its FP8 "
             "matmuls read are gathered in E4M3 (f8e4m3fn).", "",
             "| mesh | policy | reduce_dtype | params gathered (dtype) | params MiB | gradients reduced (dtype) "
             "| gradients MiB | as reduce-scatters | total MiB | vs fp32 |",
             "| --- | --- | --- | --- | ---: | --- | ---: | ---: | ---: | ---: |"]
    for r in rows:
        p, g = r["params"], r["gradients"]
        ratio = r["sent_bytes"] / reference[r["layout"]] if reference.get(r["layout"]) else float("nan")
        lines.append(f"| {r['layout']} | {r['policy']} | {r['reduce_dtype']} | {p['count']} ({', '.join(p['dtypes']) or '-'}) | "
                     f"{p['sent_bytes'] / 2 ** 20:.3f} | {g['count']} ({', '.join(g['dtypes']) or '-'}) | "
                     f"{g['sent_bytes'] / 2 ** 20:.3f} | {g['scattered_sent_bytes'] / 2 ** 20:.3f} | "
                     f"{r['sent_bytes'] / 2 ** 20:.3f} | {ratio:.2f}x |")
    lines += ["", f"jax {env.get('jax')}, {env.get('device')} x {env.get('device_count')}, {env.get('date')}; "
              "reproduce: `python -m benchmarks.communication`"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> list[dict[str, Any]] | None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.communication", description=__doc__.split("\n\n")[0])
    p.add_argument("--layouts", default=",".join(LAYOUTS), help="DATAxFSDP meshes, comma-separated")
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--out", default=None, help="directory for communication.{json,md} (default benchmarks/results)")
    args = p.parse_args(argv)
    if FLAG not in os.environ.get("XLA_FLAGS", ""):  # devices are fixed when JAX starts: run in a fresh process
        env = {**os.environ, "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} {FLAG}".strip(), "JAX_PLATFORMS": "cpu"}
        cmd = [sys.executable, "-m", "benchmarks.communication", *(sys.argv[1:] if argv is None else argv)]
        subprocess.run(cmd, env=env, check=True)
        return None
    from benchmarks.report import RESULTS, environment

    rows = [measure(layout, policy) for layout in args.layouts.split(",") for policy in args.policies.split(",")]
    env = environment()
    out = pathlib.Path(args.out) if args.out else RESULTS
    out.mkdir(parents=True, exist_ok=True)
    (out / "communication.json").write_text(json.dumps({"rows": rows, "environment": env}, indent=2) + "\n")
    text = markdown(rows, env)
    (out / "communication.md").write_text(text)
    print(text)
    return rows


if __name__ == "__main__":
    main()
