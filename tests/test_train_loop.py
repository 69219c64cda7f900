"""Experiments end to end: CLI, outputs, resume bit for bit, the non-finite stop rule."""

import json
import os
import subprocess
import sys

import jax
import pytest
import yaml

from helpers import assert_bitwise_equal, saved_leaves, saved_state
from train import Checkpointer, ConfigError, NonFiniteError, read_metrics, run
from train.cli import main
from train.config import from_dict

TINY = {
    "steps": 8, "log_every": 2, "eval_every": 4, "checkpoint_every": 4, "progress": False,
    "inference_dtypes": [],
    "model": {"name": "resnet", "stage_sizes": [1], "width": 4},
    "data": {"name": "digits", "batch_size": 8, "eval_batch_size": 100, "eval_batches": 1, "prefetch": 1},
    "optimizer": {"name": "adamw", "lr": 3e-3, "weight_decay": 1e-4},
    "accum_steps": 2,
    "precision": {"policy": "mixed_f16", "loss_scale": "dynamic", "growth_interval": 3},
}


def _config(workdir, **changes):
    raw = json.loads(json.dumps(TINY))
    raw["workdir"] = str(workdir)
    for key, value in changes.items():
        node = raw
        *parents, last = key.split(".")
        for part in parents:
            node = node[part]
        node[last] = value
    return from_dict(raw)


def test_run_writes_metrics_config_checkpoints_and_summary(tmp_path, capsys):
    summary = run(_config(tmp_path / "run", inference_dtypes=["float16"]))
    out = capsys.readouterr().out
    assert "== summary" in out and "steps/s" in out and "loss scale" in out
    workdir = tmp_path / "run"
    records = read_metrics(str(workdir))
    train = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train] == [2, 4, 6, 8]
    for r in train:
        assert {"step", "loss", "loss_scale", "grads_finite", "grad_norm", "learning_rate"} <= set(r)
    assert [r["step"] for r in records if r["kind"] == "eval"] == [4, 8]
    assert {r["dtype"] for r in records if r["kind"] == "inference"} == {"float32", "float16"}
    saved = yaml.safe_load((workdir / "config.yaml").read_text())
    assert saved["model"]["num_classes"] == 10 and saved["precision"]["policy"] == "mixed_f16"
    assert sorted(os.listdir(workdir / "checkpoints")) == ["4", "8"]
    assert any(name.startswith("events.out.tfevents") for name in os.listdir(workdir / "tensorboard"))
    assert json.loads((workdir / "summary.json").read_text())["steps"] == summary["steps"] == 8
    assert summary["loss_scale"]["increases"] >= 1  # growth_interval 3 over 8 finite steps


def test_an_interrupted_run_resumes_to_the_same_params_bit_for_bit(tmp_path):
    run(_config(tmp_path / "straight"))

    def interrupt(record):
        if record["kind"] == "train" and record["step"] == 6:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt, match="saved a checkpoint at step 7"):  # one step ran ahead of the log
        run(_config(tmp_path / "resumed"), on_record=interrupt)
    assert Checkpointer(tmp_path / "resumed" / "checkpoints").latest_step() == 7
    run(_config(tmp_path / "resumed"))
    step_a, a = saved_leaves(tmp_path / "straight")
    step_b, b = saved_leaves(tmp_path / "resumed")
    assert step_a == step_b == 8
    assert_bitwise_equal(a, b)


def test_a_larger_steps_continues_a_finished_run(tmp_path):
    run(_config(tmp_path / "straight"))
    run(_config(tmp_path / "extended", steps=4))
    run(_config(tmp_path / "extended", steps=8))
    assert_bitwise_equal(saved_leaves(tmp_path / "straight")[1], saved_leaves(tmp_path / "extended")[1])
    steps = [r["step"] for r in read_metrics(str(tmp_path / "extended")) if r["kind"] == "train"]
    assert steps == [2, 4, 6, 8]


def test_a_different_experiment_in_the_same_workdir_is_refused(tmp_path):
    run(_config(tmp_path / "run", steps=2))
    with pytest.raises(ConfigError, match=r"different experiment \(optimizer.lr: 0.003 -> 0.01\)"):
        run(_config(tmp_path / "run", **{"optimizer.lr": 1e-2}))


def test_nonfinite_gradients_at_the_minimum_scale_stop_with_the_param_path(tmp_path):
    config = _config(tmp_path / "run", steps=20, checkpoint_every=2, max_nonfinite_steps=3,
                     **{"precision.loss_scale": "static", "precision.initial_scale": 1e30})
    with pytest.raises(NonFiniteError) as info:
        run(config)
    message = str(info.value)
    assert "stopped at step 3" in message and "3 consecutive steps (since step 1)" in message
    assert "params/" in message and "minimum loss scale 1e+30" in message
    error = [r for r in read_metrics(str(tmp_path / "run")) if r["kind"] == "error"]
    assert error and error[0]["param"].startswith("params/") and error[0]["first_nonfinite_step"] == 1
    ckpt = Checkpointer(tmp_path / "run" / "checkpoints")
    # The state at the stop is checkpointed; every step was skipped, so its
    # params are the initial ones, bit for bit.
    assert ckpt.all_steps() == [2, 4] and "checkpointed at step 4" in message
    ckpt.close()
    assert_bitwise_equal(jax.tree_util.tree_leaves(saved_state(tmp_path / "run", 2)[1]["params"]),
                          jax.tree_util.tree_leaves(saved_state(tmp_path / "run", 4)[1]["params"]))


def test_cli_runs_a_config_with_overrides(tmp_path, capsys):
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(TINY))
    assert main([str(path), "steps=2", f"workdir={tmp_path / 'cli'}", "optimizer.lr=1e-3",
                 "precision.policy=mixed_bf16", "model.width=2"]) == 0
    saved = yaml.safe_load((tmp_path / "cli" / "config.yaml").read_text())
    assert saved["steps"] == 2 and saved["optimizer"]["lr"] == 1e-3 and saved["model"]["width"] == 2
    assert saved["precision"]["policy"] == "mixed_bf16"
    assert "== summary: resnet on digits, policy mixed_bf16" in capsys.readouterr().out


def test_python_m_train_default_config_entry_point(tmp_path):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-m", "train", "configs/default.yaml", "steps=3", "log_every=1",
                           f"workdir={tmp_path / 'default'}", "inference_dtypes=[]"],
                          capture_output=True, text=True, cwd=root, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "== summary: mlp on digits, policy mixed_f16" in proc.stdout
    assert "Traceback" not in proc.stderr


def test_a_run_resumes_after_its_model_gained_fields(tmp_path):
    run(_config(tmp_path / "run", steps=2))
    path = tmp_path / "run" / "config.yaml"
    old = yaml.safe_load(path.read_text())
    del old["model"]["dtype"]  # as written before the model had this field
    path.write_text(yaml.safe_dump(old))
    run(_config(tmp_path / "run", steps=3))
