"""Tensor parallelism trains as one device does: the loss after 300 steps, on 8 CPU devices.

Part 1 (the API): the project's GPT (2 layers, d_model 128, 4 heads, vocabulary 128, 16 x 64
tokens of ``synthetic_text``, AdamW) trained 300 steps on one device and on ``tensor=2``
(data 4) and ``fsdp=2 tensor=4`` (sequence parallel), with the row-parallel sums in float32
(``precision.tensor_reduce_dtype``, the default) and in bfloat16, under ``mixed_bf16``,
``mixed_fp8`` (every matmul but attention's in FP8) and ``mixed_bf16`` with the loss computed in
blocks of rows (``precision.blockwise_loss``, its threshold lowered to this vocabulary). Per run:
the mean loss of the last 20 steps and its drift from one device's.

Part 2 (the CLI): ``python -m train CONFIG mesh.tensor=4 mesh.fsdp=2`` against one device,
300 steps, for the built-in GPT, a Hugging Face Flax GPT-2 (random init from a small
``config.json``) and a user's NNX LM (``examples/user_models/nnx_lm.yaml``): the final
training loss (the mean of the last logged window) and its drift.

    python -m benchmarks.tensor_parallel_parity [--steps 300] [--part api,cli] [--out DIR]

Writes ``tensor-parallel-parity.{json,md}`` to ``--out`` (default ``benchmarks/results``).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parent.parent
DEVICES = 8
FLAG = f"--xla_force_host_platform_device_count={DEVICES}"
GPT = dict(vocab_size=128, block_size=64, num_layers=2, num_heads=4, d_model=128)
BATCH, SEQ = 16, 64
#: (name, policy, blockwise loss)
POLICIES = (("mixed_bf16", "mixed_bf16", False), ("mixed_fp8", "mixed_fp8", False),
            ("mixed_bf16 + blockwise loss", "mixed_bf16", True))
#: (data, fsdp, tensor, tensor_reduce_dtype): data parallelism alone shows what the devices' rounding does
MESHES = ((8, 1, 1, "f32"), (4, 1, 2, "f32"), (1, 2, 4, "f32"), (4, 1, 2, "bf16"), (1, 2, 4, "bf16"))


def train_api(policy: str, blockwise: bool, mesh: tuple | None, steps: int) -> list[float]:
    """The losses of ``steps`` steps of the GPT under ``policy`` on ``mesh`` (None: one device)."""
    import jax
    import numpy as np
    import optax

    import precision
    from precision.blockwise import transform
    from train import Layout, create_train_state, make_mesh, make_train_step
    from train.data import load_dataset
    from train.models import GPT as Model
    from train.parallel.distributed import to_host

    if blockwise:  # this vocabulary's logits are far below the default threshold: blocks of 4 rows
        transform.MIN_LOGITS_BYTES, transform.BLOCK_BYTES = 1, 4 * SEQ * GPT["vocab_size"] * 4
    data = load_dataset("synthetic_text", num_train=8192, num_test=256, num_classes=GPT["vocab_size"], seq_len=SEQ)
    layout = None
    if mesh is not None:
        d, f, t, reduce_dtype = mesh
        layout = Layout(make_mesh(d, f, jax.devices()[:d * f * t], tensor=t), tensor_reduce_dtype=reduce_dtype)
    state = create_train_state(Model(**GPT), policy, optax.adamw(3e-3), jax.random.PRNGKey(0),
                               data.sample_input(1), layout=layout,
                               fp8={"min_size": 0} if policy == "mixed_fp8" else None,
                               ops=precision.op_lists(blockwise_loss=True) if blockwise else None)
    step = make_train_step(task="language_model", layout=layout)
    losses = []
    for i in range(steps):
        batch = data.train_batch(i, BATCH, seed=0)
        batch = layout.global_batch(batch, BATCH) if layout is not None else jax.device_put(batch)
        state, metrics = step(state, batch)
        losses.append(float(to_host(metrics["loss"])))  # one step at a time: 8 CPU devices share few threads
    return losses


def _tail_mean(losses: list[float], n: int = 20) -> float:
    return sum(losses[-n:]) / len(losses[-n:])


def part_api(steps: int, policies: list[str], meshes: list[tuple]) -> list[dict[str, Any]]:
    """The GPT on one device and on each of ``meshes`` under each of ``policies`` (names of :data:`POLICIES`)."""
    rows = []
    for name, policy, blockwise in [p for p in POLICIES if p[0] in policies]:
        one = train_api(policy, blockwise, None, steps)
        reference = _tail_mean(one)
        rows.append({"policy": name, "mesh": "1 device", "tensor_reduce_dtype": "-", "loss": reference, "drift": 0.0})
        for mesh in meshes:
            if mesh[3] == "bf16" and name != "mixed_bf16":
                continue
            losses = train_api(policy, blockwise, mesh, steps)
            loss = _tail_mean(losses)
            rows.append({"policy": name, "mesh": f"data={mesh[0]} fsdp={mesh[1]} tensor={mesh[2]}",
                         "tensor_reduce_dtype": mesh[3], "loss": loss, "drift": loss / reference - 1,
                         "max_step_drift": max(abs(a / b - 1) for a, b in zip(losses, one))})
            print(rows[-1], flush=True)
    return rows


def _hf_gpt2(directory: str) -> str:
    config = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_layer": 2, "n_embd": 128, "n_head": 4,
              "vocab_size": 128, "n_positions": SEQ, "n_ctx": SEQ, "resid_pdrop": 0.0, "embd_pdrop": 0.0,
              "attn_pdrop": 0.0}
    path = os.path.join(directory, "gpt2")
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return path


def _cli_models(directory: str) -> dict[str, list[str]]:
    common = ["data.name=synthetic_text", "data.num_classes=128", f"data.seq_len={SEQ}", f"data.batch_size={BATCH}",
              "data.num_train=8192", "data.num_test=256", "data.eval_batch_size=16", "data.eval_batches=4",
              "precision.policy=mixed_bf16", "optimizer.name=adamw", "optimizer.lr=3e-3", "log_every=20",
              "eval_every=0", "checkpoint_every=0", "inference_dtypes=[]", "progress=false", "steps_per_call=1"]
    default = str(ROOT / "configs" / "default.yaml")
    return {
        "GPT (built-in)": [default, "model.name=gpt", "model.num_layers=2", "model.d_model=128", "model.num_heads=4",
                           f"model.block_size={SEQ}", *common],
        "Hugging Face Flax GPT-2": [default, "model.name=train.weights.huggingface:model",
                                    f"model.path={_hf_gpt2(directory)}", "model.output=logits", *common],
        "NNX LM (examples/user_models)": [str(ROOT / "examples" / "user_models" / "nnx_lm.yaml"), "model.vocab_size=128",
                                          f"model.max_len={SEQ}", "model.width=128", *common],
    }


def _run_cli(args: list[str], devices: int, workdir: str, steps: int) -> float:
    """The last logged training loss of ``python -m train ARGS`` on ``devices`` CPU devices."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
    env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split() if "device_count" not in f)
    if devices > 1:
        env["XLA_FLAGS"] = f"{env['XLA_FLAGS']} --xla_force_host_platform_device_count={devices}".strip()
        args = [*args, "mesh.tensor=4", "mesh.fsdp=2"]
    cmd = [sys.executable, "-m", "train", *args, f"steps={steps}", f"workdir={workdir}"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT)
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    records = [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl")) if line.strip()]
    return [r["loss"] for r in records if r.get("kind") == "train"][-1]


def part_cli(steps: int) -> list[dict[str, Any]]:
    rows = []
    with tempfile.TemporaryDirectory() as directory:
        for name, args in _cli_models(directory).items():
            one = _run_cli(args, 1, os.path.join(directory, f"{len(rows)}-one"), steps)
            split = _run_cli(args, DEVICES, os.path.join(directory, f"{len(rows)}-tp"), steps)
            rows.append({"model": name, "one_device": one, "tensor4_fsdp2": split, "drift": split / one - 1})
            print(rows[-1], flush=True)
    return rows


def _merged(old: list, new: list, key: tuple) -> list:
    """``old`` rows with those of ``new`` in their place (by ``key``), new ones after."""
    fresh = {tuple(r[k] for k in key): r for r in new}
    kept = [fresh.pop(tuple(r[k] for k in key), r) for r in old]
    return kept + list(fresh.values())


def markdown(api: list, cli: list, steps: int, env: dict) -> str:
    lines = ["# Tensor parallelism against one device (8 CPU devices)", ""]
    if api:
        lines += [f"The project's GPT ({GPT['num_layers']} layers, d_model {GPT['d_model']}, vocabulary "
                  f"{GPT['vocab_size']}, {BATCH} x {SEQ} tokens of synthetic_text, AdamW 3e-3), {steps} steps: the mean "
                  "loss of the last 20 steps; `drift` against one device; `worst step`: the largest drift of any "
                  "single step's loss. `data=8`: data parallelism alone, the drift the devices' own rounding makes "
                  "(its gradients summed in another order).", "",
                  "| policy | mesh | tensor_reduce_dtype | loss | drift | worst step |", "| --- | --- | --- | ---: | ---: | ---: |"]
        order = {p[0]: i for i, p in enumerate(POLICIES)}
        api = sorted(api, key=lambda r: (order.get(r["policy"], 99), r["mesh"] != "1 device", "tensor=1" not in r["mesh"],
                                         r["tensor_reduce_dtype"] != "f32", r["mesh"]))
        lines += [f"| {r['policy']} | {r['mesh']} | {r['tensor_reduce_dtype']} | {r['loss']:.4f} | "
                  f"{r['drift'] * 100:+.3f}% | {r.get('max_step_drift', 0) * 100:.3f}% |" for r in api]
    if cli:
        lines += ["", f"`python -m train CONFIG mesh.tensor=4 mesh.fsdp=2` (8 devices) against the same config on one "
                      f"device, {steps} steps, mixed_bf16; the last logged training loss (mean of its window).", "",
                  "| model | one device | tensor=4, fsdp=2 | drift |", "| --- | ---: | ---: | ---: |"]
        lines += [f"| {r['model']} | {r['one_device']:.4f} | {r['tensor4_fsdp2']:.4f} | {r['drift'] * 100:+.3f}% |"
                  for r in cli]
    lines += ["", f"jax {env.get('jax')}, {env.get('device')}, {env.get('date')}; reproduce: "
                  f"`python -m benchmarks.tensor_parallel_parity --steps {steps}`"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.tensor_parallel_parity", description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--part", default="api,cli", help="api, cli or both")
    p.add_argument("--policies", default=",".join(p[0] for p in POLICIES), help="the api part's policies")
    p.add_argument("--meshes", default=",".join(f"{d}x{f}x{t}:{r}" for d, f, t, r in MESHES),
                   help="the api part's meshes, DATAxFSDPxTENSOR:TENSOR_REDUCE_DTYPE")
    p.add_argument("--out", default=None, help="directory for tensor-parallel-parity.{json,md}")
    args = p.parse_args(argv)
    parts = args.part.split(",")
    if "api" in parts and FLAG not in os.environ.get("XLA_FLAGS", ""):  # devices are fixed when JAX starts
        env = {**os.environ, "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} {FLAG}".strip(), "JAX_PLATFORMS": "cpu"}
        subprocess.run([sys.executable, "-m", "benchmarks.tensor_parallel_parity", *(sys.argv[1:] if argv is None
                                                                                    else argv)], env=env, check=True)
        return
    from benchmarks.report import RESULTS, environment

    meshes = [(*map(int, m.split(":")[0].split("x")), m.split(":")[1]) for m in args.meshes.split(",")]
    api = part_api(args.steps, args.policies.split(","), meshes) if "api" in parts else []
    cli = part_cli(args.steps) if "cli" in parts else []
    out = pathlib.Path(args.out) if args.out else RESULTS
    out.mkdir(parents=True, exist_ok=True)
    env = environment()
    path = out / "tensor-parallel-parity.json"
    saved = json.loads(path.read_text()) if path.exists() else {}
    if saved.get("steps") == args.steps:  # rows not run now are kept from the last run of as many steps
        api, cli = _merged(saved.get("api", []), api, ("policy", "mesh", "tensor_reduce_dtype")), \
            _merged(saved.get("cli", []), cli, ("model",))
    path.write_text(json.dumps({"api": api, "cli": cli, "steps": args.steps, "environment": env}, indent=1) + "\n")
    text = markdown(api, cli, args.steps, env)
    (out / "tensor-parallel-parity.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
