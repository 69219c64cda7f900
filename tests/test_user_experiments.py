"""The examples' user-written models, data and loss train from YAML through
``python -m train`` and the Python API, resume bit-exactly, and evaluate; bad
references stop the CLI in one line before compute."""

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from helpers import assert_bitwise_equal, saved_leaves, subprocess_env
from train import ConfigError, load_config, run
from train.experiment.loop import build_experiment

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples" / "user_models"
QUICK = ["steps=8", "log_every=1", "checkpoint_every=4", "eval_every=0", "progress=false", "inference_dtypes=[]"]


def _cli(args, fault=None, timeout=300):
    prefix = [sys.executable, str(ROOT / "tests" / "fault_injection.py"), *fault, "--"] if fault else \
        [sys.executable, "-m", "train"]
    return subprocess.run(prefix + [str(a) for a in args], env=subprocess_env(JAX_PLATFORMS="cpu"), cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


def test_a_user_nnx_model_with_batchnorm_and_dropout_is_killed_and_resumes_bit_exactly(tmp_path):
    """From the example's YAML (a path next to it), under mixed_f16 with accumulation."""
    overrides = QUICK + ["steps=12", "precision.policy=mixed_f16", "accum_steps=2", "data.batch_size=32"]
    config = EXAMPLES / "nnx_mlp.yaml"
    straight = run(load_config(config, overrides + [f"workdir={tmp_path / 'straight'}"]), out=open(os.devnull, "w"))
    assert straight["eval"]["accuracy"] > 0.3 and straight["loss_scale_type"] == "DynamicLossScale"
    killed_dir = tmp_path / "killed"
    killed = _cli([config, *overrides, f"workdir={killed_dir}"], fault=("kill-in-step", "11"))
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    resumed = _cli([config, *overrides, f"workdir={killed_dir}"])
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    # Saves are asynchronous: the kill may lose the newest checkpoint, never an earlier one.
    assert re.search("resuming from the checkpoint at step (4|8)", resumed.stdout), resumed.stdout
    step_a, a = saved_leaves(tmp_path / "straight")
    step_b, b = saved_leaves(killed_dir)
    assert step_a == step_b == 12
    assert_bitwise_equal(a, b)  # params, optimizer and loss-scale state, BatchNorm statistics, RNG


@pytest.mark.parametrize("policy", ["mixed_bf16", "mixed_f16"])
def test_a_user_linen_lm_without_train_is_interrupted_and_resumes_bit_exactly(tmp_path, policy):
    overrides = QUICK + [f"precision.policy={policy}", "data.batch_size=8", "data.eval_batches=2",
                         "model.config.layers=1", "model.config.width=32"]
    config = EXAMPLES / "linen_lm.yaml"
    summary = run(load_config(config, overrides + [f"workdir={tmp_path / 'straight'}"]), out=open(os.devnull, "w"))
    assert summary["eval"]["perplexity"] < 32 and summary["tokens_per_sec"] > 0

    def interrupt(record):
        if record["kind"] == "train" and record["step"] == 5:
            raise KeyboardInterrupt

    resumed = load_config(config, overrides + [f"workdir={tmp_path / 'resumed'}"])
    with pytest.raises(KeyboardInterrupt, match="saved a checkpoint at step 6"):
        run(resumed, out=open(os.devnull, "w"), on_record=interrupt)
    run(resumed, out=open(os.devnull, "w"))
    assert_bitwise_equal(saved_leaves(tmp_path / "straight")[1], saved_leaves(tmp_path / "resumed")[1])


def test_user_data_and_loss_from_files_train_through_the_cli(tmp_path):
    proc = _cli([EXAMPLES / "custom_data.yaml", "steps=60", "log_every=20", "progress=false", f"workdir={tmp_path}"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    records = [yaml.safe_load(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train_records = [r for r in records if r["kind"] == "train"]
    assert "accuracy" in train_records[-1] and train_records[-1]["loss"] < train_records[0]["loss"]
    final = [r for r in records if r["kind"] == "eval"][-1]
    assert final["accuracy"] > 0.8
    resolved = yaml.safe_load((tmp_path / "config.yaml").read_text())
    assert resolved["task"].endswith("my_data.py:smoothed_cross_entropy") and resolved["model"]["in_features"] == 64


@pytest.mark.parametrize("override,message", [
    ("model.name=nnx_mlp.py:MLPP", "model.name: .*nnx_mlp.py has no attribute 'MLPP'. Did you mean 'MLP'?"),
    ("model.hiden=3", "model.hiden: MLP takes no argument 'hiden'. Did you mean 'model.hidden'?"),
    ("model.in_features=10", "model '.*MLP' cannot take my digits inputs of shape"),
    ("data.name=nothing.py:load", "data.name: file nothing.py not found"),
    ("task=my_data.py:nope", "task: .*my_data.py has no attribute 'nope'"),
])
def test_bad_references_fail_in_one_line_before_compute(tmp_path, override, message):
    config = load_config(EXAMPLES / "custom_data.yaml", [override, f"workdir={tmp_path}"])
    with pytest.raises((ConfigError, ValueError), match=message) as info:
        build_experiment(config)
    assert "\n" not in str(info.value)
    assert not (tmp_path / "checkpoints").exists()


def test_a_bad_reference_on_the_cli_exits_2_without_traceback(tmp_path):
    proc = _cli([EXAMPLES / "nnx_mlp.yaml", "model.name=nnx_mlp.py:Nope", f"workdir={tmp_path}"])
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "model.name:" in proc.stderr and "has no attribute 'Nope'" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
