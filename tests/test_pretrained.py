"""Starting from pretrained weights (``model.init_from``, ``create_train_state(init_from=...)``):
another run's checkpoint under another policy (float32 masters taken where it kept them), a
Hugging Face Flax GPT-2 fine-tuned under mixed_bf16, and the errors and reports of matching."""

import io
import json
import logging
import shutil

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import traverse_util
import pytest

from helpers import saved_state
from safetensors.numpy import save_file
from train import ConfigError, PretrainedError, create_train_state, load_pretrained, run
from train.config import from_dict
from train.weights.huggingface import model as hf_model
from train.models import MODELS
from train.weights.pretrained import pretrained_variables

transformers = pytest.importorskip("transformers")

QUICK = {"progress": False, "inference_dtypes": [], "log_every": 5, "checkpoint_every": 0}
VOCAB, LENGTH = 32, 32
TEXT = {"name": "synthetic_text", "num_classes": VOCAB, "seq_len": LENGTH, "batch_size": 16, "num_train": 20000,
        "num_test": 2000, "eval_batch_size": 64, "eval_batches": 4}
MLP_DATA = {"name": "synthetic", "input_shape": [8], "num_classes": 10, "num_train": 512, "num_test": 128,
            "batch_size": 16}
X = jnp.zeros((1, 8))
# Pretraining and fine-tuning compile one program (the session's compilation cache has it from then on).
GPT2_TRAINING = {"optimizer": {"lr": 3e-3}, "precision": {"policy": "mixed_bf16"}}


def _mlp(num_classes=10):
    return MODELS["mlp"](hidden=(16,), num_classes=num_classes)


@pytest.fixture(scope="module")
def o2_run(tmp_path_factory):
    """A run whose policy (O2) stores params in float16 and their float32 masters in the optimizer state."""
    workdir = tmp_path_factory.mktemp("o2")
    run(_mlp_config(workdir, 3), out=io.StringIO())
    return workdir, saved_state(workdir)[1]


def _mlp_config(workdir, steps, **model):
    return from_dict({**QUICK, "steps": steps, "workdir": str(workdir), "model": {"hidden": [16], **model},
                      "data": MLP_DATA, "precision": {"policy": "O2"}})


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
    """A tiny GPT-2 trained for 60 steps by this framework, exported with transformers' save_pretrained."""
    from helpers import flax_transformers

    flax_transformers()
    root = tmp_path_factory.mktemp("gpt2")
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=64,
                                  architectures=["GPT2LMHeadModel"])
    cfg.save_pretrained(root / "random")  # config.json alone: a fresh init
    model = {"name": "train.weights.huggingface:model", "path": str(root / "random"), "output": "logits"}
    run(from_dict({**QUICK, "steps": 60, "workdir": str(root / "run"), "model": model, "data": TEXT,
                   **GPT2_TRAINING}), out=io.StringIO())
    params = saved_state(root / "run")[1]["params"]
    exported = transformers.FlaxGPT2LMHeadModel(cfg, _do_init=False)
    exported.save_pretrained(root / "hf", params=params)
    exported.save_pretrained(root / "hf_safe", params=params, safe_serialization=True)
    return root, params


def test_a_run_starts_from_another_runs_float32_masters_under_another_policy(o2_run):
    workdir, saved = o2_run
    masters = saved["opt_state"]["master_params"]
    assert any(not np.array_equal(np.asarray(m), np.asarray(p, np.float32))  # the masters are not the f16 params
               for m, p in zip(jax.tree_util.tree_leaves(masters), jax.tree_util.tree_leaves(saved["params"])))
    for policy, where in (("fp32", workdir), ("pure_bf16", workdir / "checkpoints"),
                          ("mixed_f16", workdir / "checkpoints" / "3")):
        state = create_train_state(_mlp(), policy, optax.adam(1e-3), jax.random.PRNGKey(1), X, init_from=where)
        assert int(state.step) == 0 and int(state.opt_state.inner_state[0].count) == 0  # a fresh optimizer
        chex.assert_trees_all_equal(state.params, state.model.cast_params({"params": masters}, X)["params"])
        assert jax.tree_util.tree_leaves(state.params)[0].dtype == (jnp.bfloat16 if policy == "pure_bf16"
                                                                     else jnp.float32)


class WithNewHead(nn.Module):
    """The pretrained MLP as a backbone (under a scope of its own) and a new 3-class head."""

    @nn.compact
    def __call__(self, x):
        features = MODELS["mlp"](hidden=(16,), num_classes=10, name="backbone")(x)
        return nn.Dense(3, name="head")(features)


def test_a_model_wrapping_the_checkpoints_model_loads_it_under_its_scope_and_reports_the_new_head(o2_run, caplog):
    workdir, saved = o2_run
    model, x = WithNewHead(), jnp.zeros((1, 8))
    with caplog.at_level(logging.WARNING, logger="train.weights.pretrained"):
        state = create_train_state(model, "mixed_bf16", optax.adam(1e-3), jax.random.PRNGKey(1), x, init_from=workdir)
    assert [r.getMessage() for r in caplog.records] == [  # one line, as Hugging Face's "newly initialized"
        f"init_from: 2 arrays of the model are not in the checkpoint {workdir}/checkpoints/3 and start from their "
        f"fresh init: params/head/bias, params/head/kernel"]
    scratch = create_train_state(model, "mixed_bf16", optax.adam(1e-3), jax.random.PRNGKey(1), x)
    chex.assert_trees_all_equal(state.params["backbone"], saved["opt_state"]["master_params"])
    chex.assert_trees_all_equal(state.params["head"], scratch.params["head"])  # the fresh init, as from scratch


def test_bad_init_from_fails_in_one_line_unless_the_run_resumes(o2_run, tmp_path):
    workdir, _ = o2_run
    with pytest.raises(PretrainedError, match=r"^init_from: params/Dense_1/(bias|kernel) has shape \((16, )?3,?\) in "
                                              r"the model and \((16, )?10,?\) in the checkpoint .*/checkpoints/3$"):
        create_train_state(_mlp(3), "fp32", optax.adam(1e-3), jax.random.PRNGKey(0), X, init_from=workdir)
    config = _mlp_config(tmp_path / "run", 2, init_from=str(tmp_path / "nowhere"))
    with pytest.raises(ConfigError, match=r"^model\.init_from: .*/nowhere does not exist; looked for an orbax "
                                          r"checkpoint .* and Hugging Face Flax weights \(flax_model.msgpack, "
                                          r"model.safetensors\)$"):
        run(config, out=io.StringIO())
    resumed, out = shutil.copytree(workdir, tmp_path / "resumed"), io.StringIO()
    run(_mlp_config(resumed, 4, init_from=str(tmp_path / "nowhere")), out=out)  # resumes: init_from is not read
    assert f"steps 3 -> 4; resuming, so model.init_from ({tmp_path / 'nowhere'}) is ignored;" in out.getvalue()
    torch_only = tmp_path / "torch"
    torch_only.mkdir()
    (torch_only / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    (torch_only / "pytorch_model.bin").write_bytes(b"\0")
    with pytest.raises(PretrainedError, match=r"holds pytorch_model.bin only, not Flax weights; convert them once: "
                                              r"FlaxGPT2LMHeadModel.from_pretrained\('.*torch', from_pt=True\)"
                                              r".save_pretrained\(OUT\), and give OUT$"):
        load_pretrained(torch_only)
    (torch_only / "pytorch_model.bin").unlink()  # PyTorch's safetensors: the same, by the file's format metadata
    save_file({"wte.weight": np.zeros((2, 2), np.float32)}, torch_only / "model.safetensors", {"format": "pt"})
    with pytest.raises(PretrainedError, match=r"holds model.safetensors only, not Flax weights; .*from_pt=True"):
        load_pretrained(torch_only)


def test_a_fine_tuned_hugging_face_gpt2_beats_training_from_scratch(gpt2, tmp_path, caplog):
    root, _ = gpt2
    model = {"name": "train.weights.huggingface:model", "path": str(root / "hf"), "output": "logits"}

    def config(workdir, steps=8, **more):
        return from_dict({**QUICK, "steps": steps, "workdir": str(tmp_path / workdir), "data": TEXT,
                          "model": {**model, **more}, **GPT2_TRAINING})

    out = io.StringIO()
    with caplog.at_level(logging.WARNING, logger="train.weights.pretrained"):
        tuned = run(config("tuned", init_from=str(root / "hf")), out=out)
    assert not caplog.records  # every param comes from the checkpoint, and every array of it is used
    assert f"steps 0 -> 8; params from the Hugging Face weights in {root / 'hf'};" in out.getvalue()
    scratch = run(config("scratch"), out=io.StringIO())
    assert tuned["eval"]["loss"] < scratch["eval"]["loss"] - 0.5, (tuned["eval"], scratch["eval"])


def test_hugging_face_weights_load_into_the_base_model_from_msgpack_and_safetensors_alike(gpt2):
    root, trained = gpt2
    base = hf_model(str(root / "hf"), architecture="GPT2Model")  # no LM head: the checkpoint's "transformer"
    expected = jax.eval_shape(base.init, jax.random.PRNGKey(0), jnp.zeros((1, LENGTH), jnp.int32))
    assert "transformer" not in expected["params"]

    def fresh():
        raise AssertionError("every param is in the checkpoint")

    for directory in ("hf", "hf_safe"):
        variables = pretrained_variables(root / directory, expected, fresh)
        chex.assert_trees_all_equal(variables["params"], trained["transformer"])
    block = {"params": jax.eval_shape(lambda: trained["transformer"]["h"]["0"])}  # h/0 and h/1 alike
    with pytest.raises(PretrainedError, match=r"match the model's in two ways \(12 arrays each: under "
                                              r"transformer/h/0 of the checkpoint; under transformer/h/1 of"):
        pretrained_variables(root / "hf", block, fresh)
    with pytest.raises(PretrainedError, match=r"none of the model's 1 params is in the Hugging Face weights .*: "
                                              r"the model has head/kernel, the checkpoint transformer/h/0/"):
        pretrained_variables(root / "hf", {"params": {"head": {"kernel": block["params"]["ln_1"]["scale"]}}}, fresh)


def test_lora_on_a_hugging_face_gpt2_trains_its_adapters_on_the_frozen_pretrained_base(gpt2, tmp_path, caplog):
    """Issue 56: qwix's adapters on a model written by someone else, its base from the checkpoint."""
    root, trained = gpt2
    model = {"name": "train.weights.huggingface:model", "path": str(root / "hf"), "output": "logits",
             "init_from": str(root / "hf")}
    out = io.StringIO()
    with caplog.at_level(logging.WARNING, logger="train.weights.pretrained"):
        tuned = run(from_dict({**QUICK, "steps": 8, "workdir": str(tmp_path / "lora"), "data": TEXT, "model": model,
                               "finetune": {"lora": {"rank": 4}, "base": "bf16"}, **GPT2_TRAINING}), out=out)
    assert not caplog.records  # the adapters are new by design: no warning about fresh arrays
    assert "fine-tuning: LoRA adapters on 8 modules (transformer/h/0/attn/c_attn" in out.getvalue()
    saved = saved_state(tmp_path / "lora")[1]["params"]
    flat = {"/".join(k): v for k, v in traverse_util.flatten_dict(saved).items()}
    base = {"/".join(k): v for k, v in traverse_util.flatten_dict(trained).items()}
    kernel = "transformer/h/0/attn/c_attn/kernel"
    assert flat[kernel].dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(flat[kernel], np.float32),
                                  np.asarray(jnp.asarray(base[kernel]).astype(jnp.bfloat16), np.float32))
    assert np.abs(np.asarray(flat[kernel + "_lora_b"])).max() > 0  # the adapter trained
    scratch = run(from_dict({**QUICK, "steps": 8, "workdir": str(tmp_path / "scratch"), "data": TEXT,
                             "model": {k: v for k, v in model.items() if k != "init_from"}, **GPT2_TRAINING}),
                  out=io.StringIO())
    assert tuned["eval"]["loss"] < scratch["eval"]["loss"] - 0.5, (tuned["eval"], scratch["eval"])
