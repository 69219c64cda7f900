"""Tensor parallelism at the scale it is for, compiled without the devices.

Llama-3-8B and Llama-3-70B architectures (Hugging Face ``LlamaConfig`` fields in a
``config.json``, Flax ``FlaxLlamaForCausalLM`` with random init: nothing downloaded), one train
step each, compiled by XLA for 8 or 64 H100s and a 128-chip TPU v5p slice
(:func:`train.compile_for`, compile-only). Per case: whether it fits, the peak per device
from XLA's memory plan, the bytes each device sends per step by collective kind and dtype
(the GPU's compiled program; the TPU's after partitioning), the gradients' share, and the
modeled step time (GPUs only: :mod:`train.inspections.gpu_time`, a model, not a measurement).

    python -m benchmarks.tensor_parallel [--cases 8b-fsdp8,8b-tensor8] [--layers N] [--out DIR]

Each case is compiled in a process of its own (one large compile's memory freed before the
next) and its row merged into ``tensor-parallel-scale.{json,md}`` in ``--out`` (default
``benchmarks/results``); ``--layers N`` compiles N layers instead of the architecture's
(quick checks). Needs ``jax[cuda12]`` (and ``jax[tpu]`` for v5p); run with ``JAX_PLATFORMS=cpu``.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time
from typing import Any

LLAMA3 = {
    "8b": {"hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32, "num_key_value_heads": 8,
           "num_hidden_layers": 32},
    "70b": {"hidden_size": 8192, "intermediate_size": 28672, "num_attention_heads": 64, "num_key_value_heads": 8,
            "num_hidden_layers": 80},
}
COMMON = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256,
          "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
          "tie_word_embeddings": False, "hidden_act": "silu", "attention_bias": False, "mlp_bias": False}
#: name -> (architecture, target, devices, mesh overrides, policy, batch)
CASES = {
    "8b-fsdp8": ("8b", "h100", 8, ["mesh.fsdp=8"], "mixed_bf16", 8),
    "8b-tensor8": ("8b", "h100", 8, ["mesh.tensor=8"], "mixed_bf16", 8),
    "8b-fsdp2-tensor4": ("8b", "h100", 8, ["mesh.fsdp=2", "mesh.tensor=4"], "mixed_bf16", 8),
    "8b-fsdp8-lean_bf16": ("8b", "h100", 8, ["mesh.fsdp=8"], "lean_bf16", 8),
    "8b-tensor8-lean_bf16": ("8b", "h100", 8, ["mesh.tensor=8"], "lean_bf16", 8),
    "8b-fsdp2-tensor4-lean_bf16": ("8b", "h100", 8, ["mesh.fsdp=2", "mesh.tensor=4"], "lean_bf16", 8),
    "70b-h100-mixed_bf16": ("70b", "h100", 64, ["mesh.fsdp=8", "mesh.tensor=8"], "mixed_bf16", 8),
    "70b-h100-lean_bf16": ("70b", "h100", 64, ["mesh.fsdp=8", "mesh.tensor=8"], "lean_bf16", 8),
    "70b-v5p-mixed_bf16": ("70b", "v5p", 128, ["mesh.fsdp=32", "mesh.tensor=4"], "mixed_bf16", 32),
    "70b-v5p-lean_bf16": ("70b", "v5p", 128, ["mesh.fsdp=32", "mesh.tensor=4"], "lean_bf16", 32),
}
SEQ = 4096
NAME = "tensor-parallel-scale"
#: quantities of a row taken as linear in the number of layers (by :func:`extrapolate`)
LINEAR = ("peak_bytes", "sent_bytes", "gradient_sent_bytes", "activation_sent_bytes", "param_sent_bytes",
          "f32_activation_gathers_bytes", "modeled_ms")


def row_key(case: str, layers: int | None) -> str:
    """Where a case's row is saved: ``CASE`` at the architecture's depth, ``CASE@N`` at N layers."""
    return f"{case}@{layers}" if layers else case


def extrapolate(shallow: dict[str, Any], deep: dict[str, Any]) -> dict[str, Any]:
    """A case's row at its architecture's depth from rows compiled at two smaller depths.

    Every quantity is taken as linear in the number of layers (each layer adds the same
    params, optimizer state, saved activations and collectives; the embedding, head and loss
    are the intercept): ``q(L) = q(a) + (L - a) * (q(b) - q(a)) / (b - a)``. Whether it fits is
    the extrapolated peak against the device's memory.
    """
    a, b = shallow["layers"], deep["layers"]
    depth = LLAMA3[CASES[shallow["case"]][0]]["num_hidden_layers"]

    def line(x: float | None, y: float | None) -> float | None:
        return None if x is None or y is None else x + (depth - a) * (y - x) / (b - a)

    row = {**deep, "layers": None, "extrapolated_from": [a, b], "collectives": None, "seconds": None}
    row.update({k: line(shallow[k], deep[k]) for k in LINEAR})
    kinds = {k: line(shallow["sent_by_kind"].get(k, 0.0), v) for k, v in deep["sent_by_kind"].items()}
    row["sent_by_kind"] = dict(sorted(kinds.items(), key=lambda kv: -kv[1]))
    row["fits"] = row["peak_bytes"] <= row["device_bytes"]
    return row


def table_rows(saved: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Each case at full depth: compiled where it was, else extrapolated from its two shallowest compiles."""
    rows = []
    for case in CASES:
        shallow = sorted((r for k, r in saved.items() if k.startswith(f"{case}@")), key=lambda r: r["layers"])
        if case in saved:
            rows.append(saved[case])
        elif len(shallow) >= 2:
            rows.append(extrapolate(shallow[0], shallow[1]))
    return rows


def extrapolation_checks(saved: dict[str, dict[str, Any]]) -> list[str]:
    """For each case compiled both at full depth and at two depths: the extrapolation against the compile."""
    lines = []
    for row in table_rows(saved):
        shallow = sorted((r for k, r in saved.items() if k.startswith(f"{row['case']}@")), key=lambda r: r["layers"])
        if row.get("extrapolated_from") or len(shallow) < 2:
            continue
        guess = extrapolate(shallow[0], shallow[1])
        parts = [f"{name} {guess[k] / scale:.{digits}f} against {row[k] / scale:.{digits}f} compiled "
                 f"({(guess[k] / row[k] - 1) * 100:+.1f}%)"
                 for name, k, scale, digits in (("peak GiB", "peak_bytes", 2 ** 30, 1), ("sent GB", "sent_bytes", 1e9, 2),
                                                ("modeled ms", "modeled_ms", 1e-0, 0)) if guess[k] and row[k]]
        lines.append(f"- {row['case']}, from {shallow[0]['layers']} and {shallow[1]['layers']} layers: " + "; ".join(parts))
    return lines


def config_args(case: str, directory: str, layers: int | None) -> list[str]:
    """The overrides of ``configs/default.yaml`` that make ``case`` (its config.json written in ``directory``)."""
    arch, _, _, mesh, policy, batch = CASES[case]
    fields = {**COMMON, **LLAMA3[arch]}
    if layers:
        fields["num_hidden_layers"] = layers
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(fields, f)
    return ["model.name=train.weights.huggingface:model", f"model.path={directory}", "model.output=logits",
            "data.name=synthetic_text", f"data.num_classes={COMMON['vocab_size']}", f"data.seq_len={SEQ}",
            f"data.batch_size={batch}", f"data.eval_batch_size={batch}", "data.num_train=1048576",
            "data.num_test=65536", "optimizer.name=adamw", "optimizer.lr=3e-4", f"precision.policy={policy}",
            "workdir=/tmp/unused", *mesh]


def measure(case: str, layers: int | None) -> dict[str, Any]:
    """One case compiled: its row."""
    from train.config import load_config
    from train.inspections.compile_for import compile_for

    _, target, devices, mesh, policy, batch = CASES[case]
    with tempfile.TemporaryDirectory() as directory:
        root = pathlib.Path(__file__).resolve().parent.parent
        start = time.perf_counter()
        report = compile_for(load_config(root / "configs" / "default.yaml", config_args(case, directory, layers)),
                             target, devices)
    comm = report.communication
    by_kind: dict[str, float] = {}
    for c in comm.collectives:
        key = f"{c.kind} {c.dtype}"
        by_kind[key] = by_kind.get(key, 0.0) + c.sent_bytes
    return {"case": case, "target": report.target.name, "device": report.target.device_kind, "devices": devices,
            "mesh": report.mesh, "policy": policy, "batch": f"{batch} x {SEQ}", "params": report.experiment,
            "layers": layers, "fits": report.fits, "peak_bytes": report.memory["peak"],
            "device_bytes": report.target.memory_bytes, "memory": report.memory, "stage": comm.stage,
            "sent_bytes": comm.sent_bytes(), "gradient_sent_bytes": comm.sent_bytes("gradients"),
            "activation_sent_bytes": comm.sent_bytes("activations"), "param_sent_bytes": comm.sent_bytes("params"),
            "sent_by_kind": dict(sorted(by_kind.items(), key=lambda kv: -kv[1])), "collectives": comm.rows(),
            "f32_activation_gathers_bytes": sum(c.bytes for c in comm.collectives if c.kind == "all-gather"
                                                and c.dtype == "f32" and c.carries in ("activations", "params")),
            "modeled_ms": report.modeled.seconds * 1e3 if report.modeled is not None else None,
            "seconds": round(time.perf_counter() - start, 1)}


def gradients(row: dict[str, Any]) -> str:
    """The gradients' GB, or ``n/a`` where the report cannot tell them (bf16 params reduced in f32)."""
    return "n/a" if row["policy"].startswith("lean") else f"{row['gradient_sent_bytes'] / 1e9:.2f}"


def markdown(rows: list[dict[str, Any]], env: dict[str, Any], checks: list[str] = ()) -> str:
    gib, gb = 2 ** 30, 1e9
    lines = [f"# Tensor parallelism at scale, compiled without the devices", "",
             "Llama-3 architectures (Hugging Face config.json, random init), one train step, batch x 4096 tokens, "
             "AdamW, compiled by XLA for the target (compile-only: XLA's default kernels, no autotuning). Bytes "
             "each device sends per step (ring collectives) from the GPU's compiled program (the TPU's after "
             "SPMD partitioning); `f32 gathers`: bytes of activation and param all-gathers in float32 (the loss's "
             "per-vocabulary-shard statistics). Modeled step time: a model of the compiled program on the GPU's "
             "datasheet, not a measurement.", "",
             "| case | devices | mesh | policy | fits | peak GiB / device | sent GB / device | gradients GB | "
             "by kind and dtype (GB) | f32 gathers MB | modeled ms |",
             "| --- | --- | --- | --- | --- | ---: | ---: | ---: | --- | ---: | ---: |"]
    for r in rows:
        mesh = ",".join(f"{k}={v}" for k, v in r["mesh"].items() if v > 1) or "1"
        kinds = "; ".join(f"{k} {v / gb:.2f}" for k, v in r["sent_by_kind"].items() if v / gb >= 0.005)
        depth = f" ({r['layers']} layers)" if r.get("layers") else ""
        if r.get("extrapolated_from"):
            depth = " (extrapolated from {} and {} layers)".format(*r["extrapolated_from"])
        lines.append(f"| {r['case']}{depth} | {r['devices']} x {r['target']} | {mesh} | {r['policy']} | "
                     f"{'yes' if r['fits'] else 'NO'} | {r['peak_bytes'] / gib:.1f} of {r['device_bytes'] / gib:.1f} | "
                     f"{r['sent_bytes'] / gb:.2f} | {gradients(r)} | {kinds} | "
                     f"{r['f32_activation_gathers_bytes'] / 1e6:.1f} | "
                     f"{'-' if r['modeled_ms'] is None else format(r['modeled_ms'], '.0f')} |")
    lines += ["", f"jax {env.get('jax')}, {env.get('date')}; reproduce (each case): "
              "`JAX_PLATFORMS=cpu python -m benchmarks.tensor_parallel --cases CASE`; an extrapolated row: the "
              "same with `--layers 2` and `--layers 4` (each quantity linear in depth: the 4-layer value plus "
              "the per-layer slope times the remaining layers)."]
    if any(gradients(r) == "n/a" for r in rows):
        lines += ["", "`n/a`: under lean_bf16 the params are bf16 and their gradients are reduce-scattered in "
                  "float32 (`precision.reduce_dtype` auto); the report tells a gradient by its param's stored "
                  "dtype and shape, so it counts these as activations: their bytes are in `reduce-scatter f32`."]
    if checks:
        lines += ["", "The extrapolation against full-depth compiles of the same case:", "", *checks]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.tensor_parallel", description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", default=",".join(CASES), help=f"comma-separated: {', '.join(CASES)}")
    p.add_argument("--layers", type=int, default=None, help="layers to compile (default: the architecture's)")
    p.add_argument("--out", default=None, help="directory of the table (default benchmarks/results)")
    p.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # the child process: one case, JSON out
    args = p.parse_args(argv)
    cases = args.cases.split(",")
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        p.error(f"unknown case {', '.join(unknown)}; cases: {', '.join(CASES)}")
    if args.one:
        print(json.dumps(measure(cases[0], args.layers)))
        return
    from benchmarks.report import RESULTS, environment

    out = pathlib.Path(args.out) if args.out else RESULTS
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{NAME}.json"
    saved = json.loads(path.read_text()) if path.exists() else {"rows": {}}
    for case in cases:
        cmd = [sys.executable, "-m", "benchmarks.tensor_parallel", "--one", "--cases", case]
        cmd += ["--layers", str(args.layers)] if args.layers else []
        proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"})
        if proc.returncode:
            print(f"{case}: failed\n{proc.stderr[-3000:]}", file=sys.stderr)
            continue
        saved["rows"][row_key(case, args.layers)] = json.loads(proc.stdout.strip().splitlines()[-1])
        saved["environment"] = environment()
        path.write_text(json.dumps(saved, indent=1) + "\n")
        text = markdown(table_rows(saved["rows"]), saved["environment"], extrapolation_checks(saved["rows"]))
        (out / f"{NAME}.md").write_text(text)
        print(text)


if __name__ == "__main__":
    main()
