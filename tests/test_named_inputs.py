"""Models with several inputs, and models that take only JAX arrays, from a config's data
(issue 53): a diffusion UNet's ``sample, timesteps, encoder_hidden_states`` as a dict of
named inputs (keyword arguments), two arrays as a tuple (positional), through training,
evaluation, sharding, accumulation, ``--explain``, ``--check`` and ``--diagnose``; a
user's model that raises while being checked stops the CLI in one line."""

import os
import subprocess
import sys
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import yaml

import precision
from helpers import subprocess_env
from train import create_train_state, load_config, make_train_step, run
from train.data import DataError
from train.data.user import from_user_function
from train.data.model_inputs import call_arguments, describe_inputs

ROOT = Path(__file__).resolve().parent.parent
DENOISER = ROOT / "examples" / "user_models" / "denoiser.yaml"
QUICK = ["log_every=5", "checkpoint_every=0", "eval_every=0", "progress=false", "inference_dtypes=[]"]


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "train", *map(str, args)], env=subprocess_env(JAX_PLATFORMS="cpu"),
                          cwd=ROOT, capture_output=True, text=True, timeout=300)


def _records(workdir):
    return [yaml.safe_load(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]


def test_inputs_are_one_array_a_dict_of_keyword_arguments_or_a_tuple_of_positional_ones():
    x = np.zeros((2, 3))
    assert call_arguments(x) == ((x,), {})
    assert call_arguments({"sample": x, "t": x}) == ((), {"sample": x, "t": x})
    assert call_arguments((x, x)) == ((x, x), {})
    assert describe_inputs(x) == "shape (3,)" and describe_inputs({"a": x, "b": x[:, 0]}) == "a (3,), b ()"


def test_a_unet_shaped_model_with_three_named_inputs_trains_from_yaml_with_accumulation(tmp_path):
    """The example's denoiser takes only a JAX array of timesteps (as diffusers' UNet): the
    coverage check traces it on what the step passes, not NumPy values."""
    config = load_config(DENOISER, QUICK + ["steps=30", "accum_steps=2", "precision.policy=mixed_f16",
                                            f"workdir={tmp_path}"])
    summary = run(config, out=open(os.devnull, "w"))
    train = [r for r in _records(tmp_path) if r["kind"] == "train"]
    assert train[-1]["loss"] < 0.8 * train[0]["loss"], (train[0]["loss"], train[-1]["loss"])
    assert np.isfinite(summary["eval"]["mse"])


def test_the_policy_reaches_every_matmul_of_the_named_input_model_and_it_trains_like_fp32(tmp_path):
    """Its convolutions, time projection and cross-attention in half (a policy that left the
    three-input model in float32 fails here), and the loss of float32 training reached."""
    sys.path.insert(0, str(DENOISER.parent))
    from denoiser import TinyDenoiser, noisy_images

    inputs = {k: v[:4] for k, v in noisy_images(examples=8)["train"]["inputs"].items()}
    explanation = precision.explain(TinyDenoiser(), policy="mixed_bf16", **inputs)
    assert explanation.half_share == 1.0 and not explanation.uncovered, explanation.table()
    losses = {}
    for policy in ("fp32", "mixed_bf16"):
        config = load_config(DENOISER, QUICK + ["steps=40", f"precision.policy={policy}",
                                                f"workdir={tmp_path / policy}"])
        losses[policy] = run(config, out=open(os.devnull, "w"))["eval"]["mse"]
    assert losses["mixed_bf16"] == pytest.approx(losses["fp32"], rel=0.03), losses


def test_named_inputs_reach_explain_check_and_diagnose_through_the_cli(tmp_path, capsys):
    from train.cli import main

    for flag, expect in (("--explain", "cross_attn"), ("--check", "ok:"), ("--diagnose", "healthy")):
        assert main([str(DENOISER), flag, f"workdir={tmp_path}"]) == 0, flag
        out = capsys.readouterr().out
        assert expect in out, (flag, out[-1500:])


def test_named_inputs_are_sharded_over_a_two_device_mesh_with_steps_per_call(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "train", str(DENOISER), "--mesh", "data=1,fsdp=2", "steps=4",
                           "steps_per_call=2", "accum_steps=2", *QUICK, f"workdir={tmp_path}"], cwd=ROOT,
                          env=subprocess_env(JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=2"),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "2 cpu devices, mesh data=1 fsdp=2" in proc.stdout and "eval loss" in proc.stdout


class _TwoTowers(nn.Module):
    """Two positional inputs of different shapes (an encoder-decoder's two token arrays, say)."""

    @nn.compact
    def __call__(self, left, right):
        return nn.Dense(3)(jnp.concatenate([nn.Dense(8)(left), nn.Dense(8)(right.astype(jnp.float32))], -1))


def _two_tower_data(eval_right_width: int = 2):
    rng = np.random.default_rng(0)
    left, right = rng.standard_normal((64, 5)).astype(np.float32), rng.integers(0, 4, (64, 2))
    labels = (left[:, 0] > 0).astype(np.int32) + (right[:, 0] > 1)
    return {"train": {"inputs": (left[:48], right[:48]), "labels": labels[:48]},
            "eval": {"inputs": (left[48:], right[48:, :eval_right_width]), "labels": labels[48:]},
            "num_classes": 3}


def test_a_tuple_of_inputs_is_passed_in_order_through_the_train_and_eval_steps():
    data = from_user_function(_two_tower_data, {})
    batch = data.train_batch(0, 16, seed=0)
    state = create_train_state(_TwoTowers(), "mixed_bf16", optax.adam(1e-2), jax.random.key(0), data.sample_input(2))
    step = make_train_step(donate=False)
    losses = []
    for i in range(20):
        state, metrics = step(state, data.train_batch(i, 16, seed=0))
        losses.append(float(metrics["loss"]))
    assert losses[-1] < losses[0] and isinstance(batch["inputs"], tuple)
    padded = list(data.eval_batches(10))  # 16 eval examples: the last batch padded, both inputs
    assert padded[-1]["inputs"][1].shape == (10, 2) and padded[-1]["mask"].sum() == 6


def test_a_shape_mismatch_between_splits_names_the_input():
    with pytest.raises(DataError, match=r"eval split's inputs\[1\] have shape \(1,\), the train split's \(2,\)"):
        from_user_function(_two_tower_data, {"eval_right_width": 1})


def test_rows_and_reserved_names_of_named_inputs_are_named_in_the_error():
    x = np.zeros((8, 3), np.float32)

    def rows():
        split = {"inputs": {"sample": x, "timesteps": np.zeros(7, np.int32)}, "labels": np.zeros(8, np.int32)}
        return {"train": split, "eval": split}

    with pytest.raises(DataError, match=r"one row per example; got rows \{.*'inputs.timesteps': 7"):
        from_user_function(rows, {})

    def reserved():
        split = {"inputs": {"sample": x, "train": x}, "labels": np.arange(8) % 2}
        return {"train": split, "eval": split}

    with pytest.raises(DataError, match="input 'train' has a name the framework passes to the model itself"):
        from_user_function(reserved, {})


class _OnlyJaxArrays(nn.Module):
    """Refuses NumPy inputs, as diffusers' UNet does its timesteps."""

    @nn.compact
    def __call__(self, x):
        assert isinstance(x, jax.Array), "inputs should be a JAX array"
        return nn.Dense(2)(x)


def test_explain_passes_numpy_inputs_as_jax_arrays_as_a_step_does():
    explanation = precision.explain(_OnlyJaxArrays(), np.ones((2, 4), np.float32), policy="mixed_bf16")
    assert explanation.half_share == 1.0


class _Raises(nn.Module):
    @nn.compact
    def __call__(self, x):
        raise AssertionError("Timesteps should be a 1d-array")


def test_a_model_that_raises_while_checked_is_one_line_naming_the_model_and_the_check():
    with pytest.raises(ValueError, match=r"checking which of _Raises's ops the policy reaches .* failed: "
                                         r"AssertionError: Timesteps should be a 1d-array"):
        create_train_state(_Raises(), "mixed_bf16", optax.adam(1e-3), jax.random.key(0), np.ones((1, 4), np.float32))


def test_a_model_that_raises_on_the_data_stops_the_cli_in_one_line_with_exit_2(tmp_path):
    (tmp_path / "raising.py").write_text(
        "import flax.linen as nn\n\nclass Raising(nn.Module):\n    @nn.compact\n    def __call__(self, x):\n"
        "        raise AssertionError('Timesteps should be a 1d-array')\n")
    config = {"model": {"name": "raising.py:Raising"}, "data": {"name": "synthetic"}, "steps": 2,
              "workdir": str(tmp_path / "run")}
    (tmp_path / "raising.yaml").write_text(yaml.safe_dump(config))
    proc = _cli(tmp_path / "raising.yaml")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and "Timesteps should be a 1d-array" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) <= 2, proc.stderr


def test_variables_given_to_create_train_state_outlive_the_donating_step():
    """Two policies compared from one init (create_train_state's own docstring's use): the
    step donates the state's buffers, never the caller's."""
    model, x = nn.Dense(4), jnp.ones((8, 3))
    variables = model.init(jax.random.key(0), x)
    batch = {"inputs": x, "labels": jnp.zeros(8, jnp.int32)}
    for policy in ("fp32", "mixed_bf16"):
        state = create_train_state(model, policy, optax.sgd(0.1), jax.random.key(1), x, variables=variables)
        state, _ = make_train_step()(state, batch)
    leaves = jax.tree_util.tree_leaves(variables)
    assert all(not leaf.is_deleted() for leaf in leaves)
    np.testing.assert_array_equal(np.asarray(leaves[0]), np.asarray(jax.tree_util.tree_leaves(
        model.init(jax.random.key(0), x))[0]))
