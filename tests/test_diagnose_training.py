"""The doctor in training: ``python -m train CONFIG --diagnose``, the diagnosis a run
makes when it stops on non-finite gradients, and a train step left unchanged."""

import importlib.util
import io
import json
import os
import pathlib

import jax
import numpy as np
import optax
import pytest
import yaml
from helpers import ROOT, TINY_TEXT, tiny_fashion_mnist

import precision
import train
from train.cli import main

#: The MLP around a hot block (each model below defines its Block).
_HOT_MLP = '''

class HotMLP(nn.Module):
    classes: int = 10

    @nn.compact
    def __call__(self, x):
        h = nn.relu(nn.Dense(32, name="inp")(x.reshape((x.shape[0], -1))))
        h = nn.LayerNorm(name="norm")(Block(name="block")(h))
        return nn.Dense(self.classes, name="head")(h)
'''

HOT_MODEL = '''
import flax.linen as nn


class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(32, name="dense")(x) * 60000.0  # past float16's 65504 for inputs above ~1

''' + _HOT_MLP

TINY = {"steps": 40, "log_every": 5, "progress": False, "inference_dtypes": [], "max_nonfinite_steps": 3,
        "data": {"name": "digits", "batch_size": 32, "eval_batch_size": 100, "eval_batches": 1},
        "precision": {"policy": "mixed_f16", "loss_scale": "dynamic", "initial_scale": 4, "min_scale": 1}}


def _config_file(tmp_path, model, **changes):
    raw = {**json.loads(json.dumps(TINY)), "workdir": str(tmp_path / "run"), "model": {"name": model}, **changes}
    path = tmp_path / "exp.yaml"
    path.write_text(yaml.safe_dump(raw))
    return str(path)


def test_a_run_with_a_planted_overflow_stops_with_one_line_naming_the_op_module_and_verified_fix(tmp_path, capsys):
    (tmp_path / "hot_model.py").write_text(HOT_MODEL)
    config = _config_file(tmp_path, f"{tmp_path}/hot_model.py:HotMLP")
    assert main([config]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: training stopped at step")
    assert "mul in block (forward) first went non-finite" in err
    # Diagnosed at the scale the run used before the streak drove it to 1 (at 1, small gradients underflow).
    assert "at loss scale 4 (in use before it fell to 1)" in err
    # The rule it adds, not the default rules it keeps (those are in the override, in diagnosis.json).
    assert ("verified fix: add the rule [block, f32] to precision.rules; the default rules still apply"
            in err and "-> overflow 0%" in err and "BatchNorm" not in err)
    saved = json.loads((tmp_path / "run" / "diagnosis.json").read_text())
    assert saved["reason"] == "training stopped on non-finite gradients" and saved["step"] == 3
    assert saved["loss_scale"] == 4
    assert saved["first_nonfinite"] == {"op": "mul", "path": "block", "pass": "forward"}
    assert saved["problems"][0]["kind"] == "overflow" and saved["problems"][0]["path"] == "block"
    assert saved["recommendations"][0]["yaml"].startswith("precision:\n  rules: [[block, f32]")
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    diagnosis = [r for r in records if r["kind"] == "diagnosis"]
    assert diagnosis and diagnosis[0]["first_nonfinite"]["path"] == "block"
    assert os.listdir(tmp_path / "run" / "checkpoints")  # the last good state is saved as before

    # The verified rule, applied as the diagnosis wrote it (pasted into the config), trains.
    rules = yaml.safe_load(saved["recommendations"][0]["yaml"])["precision"]["rules"]
    fixed = _config_file(tmp_path, f"{tmp_path}/hot_model.py:HotMLP", workdir=str(tmp_path / "fixed"),
                         precision={**TINY["precision"], "rules": rules})
    assert main([fixed]) == 0


HOT_DENSE_MODEL = '''
import flax.linen as nn


class Block(nn.Module):
    @nn.compact
    def __call__(self, x):  # a kernel past float16's 65504: cast to float16 for its matmul, it overflows
        return nn.Dense(32, name="boost", kernel_init=nn.initializers.normal(60000.0))(x)

''' + _HOT_MLP


def test_a_planted_overflow_in_a_dense_names_the_matmul_not_the_cast_in_the_stop_line(tmp_path, capsys):
    (tmp_path / "hot_model.py").write_text(HOT_DENSE_MODEL)
    assert main([_config_file(tmp_path, f"{tmp_path}/hot_model.py:HotMLP")]) == 1
    err = capsys.readouterr().err.strip()
    assert "dot_general in block/boost (forward) first went non-finite" in err, err
    assert "convert_element_type" not in err
    assert "verified fix: add the rule [block/boost, f32] to precision.rules; the default rules still apply" in err
    saved = json.loads((tmp_path / "run" / "diagnosis.json").read_text())
    assert saved["first_nonfinite"] == {"op": "dot_general", "path": "block/boost", "pass": "forward"}
    overflow = saved["problems"][0]
    assert overflow["op"] == "dot_general" and "dot_general's operand, cast to float16 for it" in overflow["detail"]
    # What to paste still keeps the default rules (a config's rules replace them).
    assert saved["recommendations"][0]["overrides"][0].startswith("precision.rules=[[block/boost, f32], [BatchNorm")


def test_diagnose_flag_reads_the_newest_checkpoint_and_leaves_checkpoints_untouched(tmp_path, capsys):
    config = _config_file(tmp_path, "mlp", steps=4, checkpoint_every=2)
    assert main([config]) == 0
    checkpoints = tmp_path / "run" / "checkpoints"
    before = {p: os.stat(os.path.join(d, p)).st_mtime_ns for d, _, files in os.walk(checkpoints) for p in files}
    capsys.readouterr()
    assert main([config, "--diagnose", "--diagnose-steps", "2"]) == 0
    out = capsys.readouterr().out
    assert f"diagnosing from the checkpoint at step 4 in {checkpoints}" in out
    assert "MLP under p=f32,c=f16,o=f32 (loss scale" in out and "healthy" in out
    after = {p: os.stat(os.path.join(d, p)).st_mtime_ns for d, _, files in os.walk(checkpoints) for p in files}
    assert after == before
    saved = json.loads((tmp_path / "run" / "diagnosis.json").read_text())
    assert saved["healthy"] and saved["problems"] == [] and saved["recommendations"] == []
    assert [s["step"] for s in saved["steps_diagnosed"]] == [5, 6]


def test_diagnose_steps_must_be_positive(tmp_path, capsys):
    assert main([_config_file(tmp_path, "mlp"), "--diagnose", "--diagnose-steps", "0"]) == 2
    assert capsys.readouterr().err.strip() == "error: --diagnose-steps must be at least 1, got 0"


def test_the_train_step_compiles_to_the_same_program_whether_or_not_the_doctor_ran():
    from train.models import MLP

    x = jax.random.normal(jax.random.key(0), (8, 16))
    batch = {"inputs": x, "labels": jax.numpy.arange(8) % 4}

    def hlo():
        state = train.create_train_state(MLP(hidden=(32,), num_classes=4), "mixed_f16", optax.adam(1e-3),
                                         jax.random.PRNGKey(0), x[:1])
        return train.make_train_step().lower(state, batch).as_text(), state

    before, state = hlo()
    diagnosis = train.diagnose_state(state, batch, train.get_task("classification"))
    assert diagnosis.healthy
    precision.diagnose(MLP(hidden=(32,), num_classes=4), x, policy="mixed_f16",
                       loss_fn=lambda out: out.astype(jax.numpy.float32).mean())
    after, _ = hlo()
    assert after == before


# ----------------------------------------------------------------------------- (f) no false alarms

#: The models of linen_gpt.yaml and hf_style.yaml are diagnosed in test_diagnose_models (as models, not runs).
SHIPPED = sorted((ROOT / "configs").glob("*.yaml")) + sorted(
    p for p in (ROOT / "examples" / "user_models").glob("*.yaml") if p.stem not in ("linen_gpt", "hf_style"))


def _one_per_model_and_data(paths):
    """The shipped configs that are not a twin of another: fp32 ones have no half-precision
    numerics to diagnose, and of the half-precision twins of one model on one data (the
    shipped ResNet and GPT under mixed_f16 and mixed_bf16) float16's, whose range is the
    narrow one, is kept; bf16 stays covered by the user models (linen_lm, nnx_mlp). Each
    twin costs 40-70 s of CI."""
    from train.config import load_config

    kept = {}
    for path in paths:
        config = load_config(path)
        if config.precision.policy == "fp32":
            continue
        key = (config.model.name, config.data.name, path.parent)
        if key not in kept or config.precision.policy == "mixed_f16":
            kept[key] = path
    return sorted(kept.values())


HALF = _one_per_model_and_data(SHIPPED)


@pytest.mark.parametrize("path", HALF, ids=lambda p: p.stem)
def test_every_shipped_config_diagnoses_clean_under_its_policy(path, tmp_path):
    """On small batches of tiny stand-ins for the data CI lacks (random Fashion-MNIST pixels, a short text)."""
    from train.config import load_config

    overrides = [f"workdir={tmp_path / 'run'}", "data.batch_size=4"]
    config = load_config(path)
    if config.data.name == "fashion_mnist":
        overrides.append(f"data.path={tiny_fashion_mnist(tmp_path)}")
    elif config.data.name == "shakespeare":
        (tmp_path / "plays.txt").write_text(TINY_TEXT)
        overrides.append(f"data.path={tmp_path / 'plays.txt'}")
    diagnosis, written = train.diagnose_experiment(load_config(path, overrides), out=io.StringIO())
    assert diagnosis.healthy, str(diagnosis)
    assert json.loads(pathlib.Path(written).read_text())["healthy"]


def test_the_example_script_diagnoses_clean_under_its_policy():
    """examples/mixed_f16_digits.py's model and data, under its default policy and loss scale."""
    spec = importlib.util.spec_from_file_location("mixed_f16_digits", ROOT / "examples" / "mixed_f16_digits.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    from sklearn.datasets import load_digits

    digits = load_digits()
    x, y = (digits.data[:128] / 16.0).astype(np.float32), digits.target[:128].astype(np.int32)

    def loss_fn(logits):
        return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jax.numpy.float32), y).mean()

    diagnosis = precision.diagnose(example.MLP(), x, policy="params=f32,compute=f16", loss_fn=loss_fn,
                                   loss_scale=precision.get_loss_scale("auto", "params=f32,compute=f16"))
    assert diagnosis.healthy, str(diagnosis)


def test_diagnose_flag_skips_a_corrupt_checkpoint_and_leaves_it_where_it_is(tmp_path, capsys):
    config = _config_file(tmp_path, "mlp", steps=4, checkpoint_every=2)
    assert main([config]) == 0
    newest = tmp_path / "run" / "checkpoints" / "4"
    largest = max((p for p in newest.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    largest.write_bytes(b"\0" * largest.stat().st_size)
    capsys.readouterr()
    assert main([config, "--diagnose"]) == 0
    out = capsys.readouterr().out
    assert "warning: checkpoint" in out and "trying an older one" in out
    assert "diagnosing from the checkpoint at step 2" in out
    assert newest.is_dir() and not (tmp_path / "run" / "checkpoints.corrupt").exists()
