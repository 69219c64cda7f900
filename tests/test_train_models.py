"""Every model under every preset: finite loss and gradients, dtypes as the policy says,
norms and BatchNorm statistics in float32, attention softmax in float32 under O1."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import precision
from train import cast_for_inference, create_train_state, inference_report
from train.data import load_dataset
from train.models import GPT, MLP, ResNet

PRESETS = ("fp32", "mixed_bf16", "mixed_f16", "pure_bf16", "pure_f16", "O1", "O2", "O3")
DIGITS = load_dataset("digits")
TEXT = load_dataset("synthetic_text", num_train=2000, num_test=500, num_classes=16, seq_len=8)
MODELS = {
    "mlp": (lambda: MLP(hidden=(16,), num_classes=10), DIGITS),
    "resnet": (lambda: ResNet(stage_sizes=(1, 1), width=4, num_classes=10), DIGITS),
    "gpt": (lambda: GPT(vocab_size=16, block_size=8, num_layers=1, num_heads=2, d_model=16), TEXT),
}


def _is_norm(path):
    return any("Norm" in str(getattr(k, "key", "")) or "ln_f" in str(getattr(k, "key", "")) for k in path)


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("name", MODELS)
def test_model_trains_under_preset(name, preset):
    make, data = MODELS[name]
    model = precision.with_policy(make(), preset)
    policy = model.policy
    batch = data.train_batch(0, 4, seed=0)
    variables = model.init({"params": jax.random.PRNGKey(0)}, batch["inputs"], train=False)
    params, state = variables["params"], {k: v for k, v in variables.items() if k != "params"}
    for path, p in jax.tree_util.tree_leaves_with_path(params):
        expected = jnp.float32 if (_is_norm(path) and preset != "O3") else policy.param_dtype
        assert p.dtype == expected, (jax.tree_util.keystr(path), p.dtype)
    assert all(x.dtype == jnp.float32 for x in jax.tree_util.tree_leaves(state))  # BatchNorm statistics

    @jax.jit
    def loss_and_grads(params):
        def loss_fn(params):
            out = model.apply({"params": params, **state}, batch["inputs"], train=True,
                              mutable=list(state) or False)
            logits = out[0] if state else out
            loss = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), batch["labels"])
            return loss.mean(), logits.dtype
        (loss, dtype), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        return loss, grads, jnp.zeros((), dtype)

    loss, grads, out = loss_and_grads(params)
    assert out.dtype == policy.output_dtype
    assert np.isfinite(float(loss)) and float(loss) > 0
    assert bool(precision.all_finite(grads))
    assert jax.tree_util.tree_structure(grads) == jax.tree_util.tree_structure(params)
    assert all(g.dtype == p.dtype for g, p in zip(jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(params)))


def _softmax_exp_dtypes(preset, rules=None, autocast=True):
    make, data = MODELS["gpt"]
    model = precision.with_policy(make(), preset, rules, autocast=autocast)
    x = data.train_batch(0, 2, seed=0)["inputs"]
    variables = model.init(jax.random.PRNGKey(0), x)
    jaxpr = jax.make_jaxpr(lambda v: model.apply(v, x))(variables)
    dtypes = set()

    def visit(jaxpr):
        for eqn in jaxpr.eqns:
            aval = eqn.invars[0].aval if eqn.invars else None
            if eqn.primitive.name == "exp" and aval.ndim >= 4 and aval.shape[-2:] == (x.shape[1],) * 2:  # (..., q, k)
                dtypes.add(aval.dtype)
            for param in eqn.params.values():  # sub-programs: jit, custom_jvp, remat (an open jaxpr), cond branches
                for sub in param if isinstance(param, (tuple, list)) else (param,):
                    inner = sub if hasattr(sub, "eqns") else getattr(sub, "jaxpr", None)
                    if inner is not None and hasattr(inner, "eqns"):
                        visit(inner)

    visit(jaxpr.jaxpr)
    return dtypes


def test_attention_softmax_is_float32_under_o1_and_by_rule():
    f32 = jnp.dtype(jnp.float32)
    assert _softmax_exp_dtypes("mixed_f16") == {f32}  # autocast: exp is deny-listed
    # jax.nn.dot_product_attention computes its softmax in float32 even from half operands
    assert _softmax_exp_dtypes("mixed_f16", autocast=False) == {f32}
    assert _softmax_exp_dtypes("O1", autocast=False) == {f32}
    assert _softmax_exp_dtypes("mixed_f16", [("LayerNorm", "f32"), ("Softmax", "f32")], autocast=False) == {f32}


def test_half_precision_inference_reports_accuracy_against_float32():
    state = create_train_state(MLP(hidden=(32,)), "O2", optax.adam(1e-2), jax.random.PRNGKey(0),
                               DIGITS.sample_input(1))
    half = cast_for_inference(state, "float16")
    dense = half.params["Dense_0"]["kernel"]
    assert dense.dtype == jnp.float16 and half.params["LayerNorm_0"]["scale"].dtype == jnp.float32
    report = inference_report(state, lambda: DIGITS.eval_batches(128), "classification", ("float16", "bfloat16"))
    assert set(report) == {"float32", "float16", "bfloat16"}
    for dtype in ("float16", "bfloat16"):
        assert report[dtype]["accuracy_delta"] == pytest.approx(report[dtype]["accuracy"] - report["float32"]["accuracy"])
        assert abs(report[dtype]["loss"] - report["float32"]["loss"]) < 0.05
