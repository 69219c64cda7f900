"""Models written the way other projects write them (tests/foreign_models.py) go
through precision and the framework as their authors wrote them: NNX scan over
layers with per-layer dropout keys, rules on methods other than ``__call__``,
explain rows at the paths of params and rules."""

import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import precision
import train
from helpers import all_eqns
from foreign_models import EncoderDecoder, ScannedNNX, TiedNNX
from helpers import assert_bitwise_equal, saved_leaves

HERE = Path(__file__).resolve().parent
QUICK = ["log_every=1", "eval_every=0", "progress=false", "inference_dtypes=[]", "data.batch_size=32",
         "data.eval_batches=1", "compile_cache=null"]


# ----------------------------------------------------------------------------- NNX scan over layers


def test_an_nnx_scan_over_layers_with_per_layer_dropout_keys_trains_reproducibly():
    data = train.load_dataset("digits")
    model = ScannedNNX(64, 10, rngs=nnx.Rngs(0, dropout=1))
    state = train.create_train_state(model, "mixed_bf16", optax.adam(1e-3), jax.random.PRNGKey(0),
                                     data.sample_input(1))
    step = train.make_train_step(donate=False)
    batch = data.train_batch(0, 32, seed=0)
    a, metrics_a = step(state, batch)
    b, metrics_b = step(state, batch)
    assert np.isfinite(float(metrics_a["loss"]))
    assert_bitwise_equal(jax.device_get(a.params), jax.device_get(b.params))  # dropout from the state's key
    other, metrics_other = step(state.replace(rng=jax.random.key_data(jax.random.PRNGKey(7))), batch)
    assert float(metrics_other["loss"]) != float(metrics_a["loss"])  # and the key drives it
    train_out = state.model.apply({"params": state.params}, batch["inputs"], rngs={"dropout": jax.random.key(3)},
                                  train=True)
    eval_out = state.model.apply({"params": state.params}, batch["inputs"], train=False)
    assert not np.allclose(train_out, eval_out)  # dropout is on in training, off in evaluation


def test_an_nnx_scan_over_layers_trains_through_the_cli_and_resumes_bit_exactly(tmp_path):
    config = train.load_config(HERE.parent / "configs" / "default.yaml", [
        *QUICK, f"model.name={HERE / 'foreign_models.py'}:ScannedNNX", "model.in_features=64",
        "precision.policy=mixed_f16",
        "steps=6", "checkpoint_every=3", "steps_per_call=1"])
    straight = train.run(config.model_copy(update={"workdir": str(tmp_path / "straight")}), out=open(os.devnull, "w"))
    assert np.isfinite(straight["final_train_loss"])
    def interrupt(record):
        if record["kind"] == "train" and record["step"] == 4:
            raise KeyboardInterrupt

    resumed = config.model_copy(update={"workdir": str(tmp_path / "resumed")})
    with pytest.raises(KeyboardInterrupt, match="saved a checkpoint at step [45]"):
        train.run(resumed, out=open(os.devnull, "w"), on_record=interrupt)
    train.run(resumed, out=open(os.devnull, "w"))
    step_a, a = saved_leaves(tmp_path / "straight")
    step_b, b = saved_leaves(tmp_path / "resumed")
    assert step_a == step_b == 6
    assert_bitwise_equal(a, b)


# ----------------------------------------------------------------------------- rules reach every method


def _jaxpr(model, *args):
    graphdef, state = nnx.split(model)
    return jax.make_jaxpr(lambda s, *a: nnx.merge(graphdef, s)(*a))(state, *args).jaxpr


def _dots(jaxpr):
    return (e for e in _eqns(jaxpr) if e.primitive.name == "dot_general")


def test_a_float32_rule_reaches_an_nnx_method_other_than_call():
    model = precision.with_policy(TiedNNX(rngs=nnx.Rngs(0)), "mixed_bf16", rules=[("embedder", "f32")])
    tokens = jnp.zeros((2, 8), jnp.int32)
    dots = list(_dots(_jaxpr(model, tokens)))
    vocab_dots = [e for e in dots if e.outvars[0].aval.shape[-1] == 50]  # embedder.attend: the tied logits
    assert vocab_dots and all(v.aval.dtype == jnp.float32 for e in vocab_dots for v in e.invars)
    assert any(v.aval.dtype == jnp.bfloat16 for e in dots for v in e.invars)  # the layers stay half
    rows = {m.path: m for m in precision.explain(TiedNNX(rngs=nnx.Rngs(0)), tokens, policy="mixed_bf16",
                                                 rules=[("embedder", "f32")]).modules}
    assert rows["embedder"].matmul_dtypes == ("f32",) and rows["embedder"].f32_reason == "a rule keeps it in float32"


def test_a_float32_rule_reaches_a_linen_method_other_than_call():
    tokens = jnp.zeros((2, 8), jnp.int32)
    explanation = precision.explain(EncoderDecoder(), tokens, policy="mixed_bf16", rules=[("embed", "f32")])
    rows = {m.path: m for m in explanation.modules}
    assert rows["embed"].matmul_dtypes == ("f32",)  # decode's embed.attend
    assert rows["decoder"].matmul_dtypes == ("bf16",)


@pytest.mark.parametrize("autocast", [True, False])
def test_a_float32_rule_reaches_every_method_without_autocast_too(autocast):
    model = precision.with_policy(TiedNNX(rngs=nnx.Rngs(0)), "mixed_bf16", rules=[("embedder", "f32")],
                                  autocast=autocast)
    dots = list(_dots(_jaxpr(model, jnp.zeros((2, 8), jnp.int32))))
    vocab_dots = [e for e in dots if e.outvars[0].aval.shape[-1] == 50]
    assert vocab_dots and all(v.aval.dtype == jnp.float32 for e in vocab_dots for v in e.invars)


# ----------------------------------------------------------------------------- explain rows


def test_explain_rows_are_the_paths_of_params_one_row_per_module_linen():
    explanation = precision.explain(EncoderDecoder(), jnp.zeros((2, 8), jnp.int32), policy="mixed_bf16")
    rows = [m.path for m in explanation.modules]
    assert rows == ["attention/attention", "attention/attention/key", "attention/attention/query",
                    "attention/output", "decoder", "embed"]
    assert all(m.param_dtypes for m in explanation.modules if m.path != "attention/attention")


def test_explain_rows_are_the_paths_of_params_one_row_per_module_nnx():
    explanation = precision.explain(TiedNNX(rngs=nnx.Rngs(0)), jnp.zeros((2, 8), jnp.int32), policy="mixed_bf16")
    rows = {m.path: m for m in explanation.modules}
    assert set(rows) == {"embedder", "layers/0/attn", "layers/1/attn"}
    assert all(m.param_dtypes and m.total_flops for m in rows.values())


def test_explain_rows_of_a_fused_attention_are_its_module():
    from train.models import GPT

    explanation = precision.explain(GPT(vocab_size=65, block_size=32, num_layers=1), jnp.zeros((2, 32), jnp.int32),
                                    policy="mixed_bf16")
    paths = [m.path for m in explanation.modules]
    assert "block_0/attn" in paths and not [p for p in paths if "GPT" in p]


# ----------------------------------------------------------------------------- outputs that are not arrays


def _config(tmp_path, *overrides):
    return train.load_config(HERE.parent / "configs" / "default.yaml", [
        *QUICK, f"model.name={HERE / 'foreign_models.py'}:DictOutputMLP", "steps=3", f"workdir={tmp_path}",
        *overrides])


@pytest.mark.parametrize("kind, said, field", [
    ("dict", "a dict with hidden (32,) float32, logits (10,) float32", "logits"),
    ("tuple", "a tuple with [0] (10,) float32, [1] (32,) float32", "0"),
    ("model_output", "a ModelOutput with logits (10,) float32, hidden_states (32,) float32", "logits"),
])
def test_a_model_whose_output_is_not_an_array_is_described_and_a_config_picks_the_field(tmp_path, kind, said, field):
    with pytest.raises(train.ConfigError) as error:
        train.build_experiment(_config(tmp_path, f"model.kind={kind}"))
    message = str(error.value)
    assert f"outputs {said} for digits, whose classification needs (10,)" in message
    assert f"set model.output to the key, attribute or index holding the logits, e.g. model.output: {field}" in message
    summary = train.run(_config(tmp_path, f"model.kind={kind}", f"model.output={field}"), out=open(os.devnull, "w"))
    assert summary["eval"]["accuracy"] > 0 and np.isfinite(summary["final_train_loss"])


def test_a_model_output_field_that_is_not_there_names_what_is(tmp_path):
    with pytest.raises(train.ConfigError, match=r"model.output: 'probs' is not in the model's output, a dict with "
                                                r"hidden \(32,\) float32, logits \(10,\) float32"):
        train.build_experiment(_config(tmp_path, "model.output=probs"))


# ----------------------------------------------------------------------------- deny-listed ops in the backward pass


_eqns = all_eqns


@pytest.mark.parametrize("policy", ["mixed_bf16", "mixed_f16"])
def test_the_exp_of_exact_gelus_derivative_runs_in_float32_in_the_backward_pass(policy):
    from foreign_models import ExactGeluMLP

    x = jax.random.normal(jax.random.key(0), (16, 8, 8))
    model = precision.with_policy(ExactGeluMLP(), policy)
    params = model.init(jax.random.key(1), x)["params"]

    def loss(p, apply):
        return jnp.sum(apply({"params": p}, x).astype(jnp.float32) ** 2)

    jaxpr = jax.make_jaxpr(jax.grad(loss), static_argnums=1)(params, model.apply).jaxpr
    exps = [e for e in _eqns(jaxpr) if e.primitive.name == "exp"]
    erfs = [e for e in _eqns(jaxpr) if e.primitive.name in ("erf", "erfc")]
    assert exps and all(e.outvars[0].aval.dtype == jnp.float32 for e in exps)  # the derivative's exp
    assert erfs and all(e.outvars[0].aval.dtype != jnp.float32 for e in erfs)  # GELU itself stays half
    reference = jax.grad(loss)(params, ExactGeluMLP().apply)
    got = jax.jit(jax.grad(loss), static_argnums=1)(params, model.apply)
    for g, r in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(reference)):
        np.testing.assert_allclose(g, r, rtol=0.05, atol=0.05 * float(jnp.abs(r).max()))


# ----------------------------------------------------------------------------- the GPT written in half by hand


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
def test_the_gpt_written_in_half_by_hand_compiles_and_trains_on_this_backend(dtype):
    from train.models import GPT

    tokens = jnp.arange(64).reshape(2, 32) % 65
    full = GPT(vocab_size=65, block_size=32, num_layers=1)
    variables = full.init(jax.random.key(0), tokens)
    half = jax.tree_util.tree_map(lambda x: x.astype(dtype), variables)
    model = GPT(vocab_size=65, block_size=32, num_layers=1, dtype=dtype)
    out = jax.jit(model.apply)(half, tokens)
    assert out.dtype == dtype
    np.testing.assert_allclose(out.astype(jnp.float32), full.apply(variables, tokens), atol=0.1)
    grads = jax.jit(jax.grad(lambda v: model.apply(v, tokens).astype(jnp.float32).sum()))(half)
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree_util.tree_leaves(grads))
