"""Int8 matmuls (``mixed_int8``): the policy, the product and its backward, convolutions,
where autocast puts them in models written the usual ways (pinned dtypes, NNX, Hugging
Face, scan/remat, attention), what explain says, and the config keys."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax import lax

import precision
from precision.autocast.program import matmul_ops
from precision.autocast.scaled import int8_quantize as q
from precision.autocast.scaled.int8_conv import int8_conv
from precision.autocast.scaled.int8_matmul import Backward, int8_dot
from user_models import LMConfig, PinnedLM, PinnedNNXMLP, PinnedResNet, ScannedLM

DOT = (((1,), (0,)), ((), ()))
EVERY = {"min_size": 0}


def _rel(a, b):
    return float(jnp.linalg.norm(jnp.asarray(a, jnp.float32) - b) / jnp.linalg.norm(b))


# ----------------------------------------------------------------------------- policy


def test_int8_is_a_compute_dtype_with_a_fallback():
    p = precision.get_policy("mixed_int8")
    assert p.int8 and not p.fp8 and p.scaled == "int8" and p.compute_dtype == jnp.bfloat16
    assert str(p) == "p=f32,c=int8/bf16,o=f32" and precision.get_policy(str(p)) == p
    assert precision.get_policy("params=f32,compute=int8/f16,output=f32").compute_dtype == jnp.float16
    assert precision.get_policy("params=f32,compute=int8/bf16") == precision.Policy("f32", "int8", "bf16")
    assert precision.get_policy("mixed_int8").with_output_dtype("bf16").int8 and p.is_mixed
    assert not precision.get_policy("lean_int8").int8  # 8-bit optimizer state is another thing


@pytest.mark.parametrize("bad, words", [
    ("int8", "compute dtype for matmuls only, not a dtype for params and outputs: write 'mixed_int8'"),
    ("params=int8,compute=int8", "param must be f32, bf16 or f16"),
    ("compute=int8,output=int8", "output must be f32, bf16 or f16"),
    ("compute=int8/", "fallback dtype"),
])
def test_bad_int8_policies_say_what_is_valid_in_one_line(bad, words):
    with pytest.raises(precision.PolicyError, match=words) as caught:
        precision.get_policy(bad)
    assert "\n" not in str(caught.value)
    with pytest.raises(precision.PolicyError, match="int8 is a compute dtype"):
        precision.Policy(np.int8, "int8", "f32")


def test_int8_options_validate_and_come_from_dicts():
    assert precision.int8_options() == precision.Int8Options("int8", False, 128, False)
    assert not precision.int8.as_int8_options({"backward": "BF16"}).int8_backward
    for bad in [dict(backward="fp8"), dict(min_size=-1), dict(stochastic_rounding="yes"), dict(attention=1)]:
        with pytest.raises(precision.PolicyError):
            precision.int8_options(**bad)
    with pytest.raises(precision.PolicyError, match="unknown option"):
        precision.int8.as_int8_options({"scaling": "rowwise"})


# ----------------------------------------------------------------------------- the product


def test_quantization_is_per_slice_symmetric_and_keeps_non_finite_visible():
    x = jnp.array([[1.0, -2.0, 0.5], [1e-6, 0.0, -1e-6], [0.0, 0.0, 0.0]])
    qx, scale = q.quantized_along(x, [1])
    assert qx.dtype == jnp.int8 and scale.shape == (3, 1)
    np.testing.assert_array_equal(qx[0], [64, -127, 32])  # 1/(2/127) = 63.5 rounds to even... to 64
    np.testing.assert_array_equal(qx[1], [127, 0, -127])  # a tiny row keeps its own scale
    assert float(scale[2, 0]) == 1.0 and int(jnp.abs(qx[2]).max()) == 0
    assert jnp.isnan(q.scales_along(jnp.array([[1.0, jnp.inf]]), [1])).all()


def test_int8_product_forward_and_backward_track_float32():
    k = jax.random.split(jax.random.PRNGKey(0), 3)
    x, w = jax.random.normal(k[0], (32, 128)), 0.05 * jax.random.normal(k[1], (128, 64))
    assert _rel(int8_dot(x, w, DOT, jnp.float32), x @ w) < 0.02
    ref = jax.grad(lambda x, w: jnp.sum(jnp.sin(x @ w)), (0, 1))(x, w)
    for backward in (Backward(), Backward(False, False, np.dtype(jnp.bfloat16)), Backward(True, True, salt=3)):
        got = jax.grad(lambda x, w: jnp.sum(jnp.sin(int8_dot(x, w, DOT, jnp.float32, backward))), (0, 1))(x, w)
        assert max(_rel(g, r) for g, r in zip(got, ref)) < 0.03, backward
    jaxpr = jax.make_jaxpr(jax.grad(lambda x, w: jnp.sum(int8_dot(x, w, DOT, jnp.float32)), (0, 1)))(x, w)
    ops = matmul_ops(jaxpr)
    assert len(ops) == 3 and all(m.int8 for m in ops) and sum(m.backward for m in ops) == 2


def test_stochastic_rounding_is_unbiased_and_deterministic():
    x = jnp.full((4096,), 0.3) * jnp.array([1.0] + [0.0] * 4095)[::-1] + 0.3  # scale 0.6/127: 0.3 -> 63.5
    noise = q.stochastic_noise(x, salt=1)
    assert jnp.array_equal(noise, q.stochastic_noise(x, salt=1))
    assert not jnp.array_equal(noise, q.stochastic_noise(x, 2))
    scale = q.scales_along(x[None], [1])[0]
    rounded = q.quantize_int8(x, scale, noise).astype(jnp.float32) * scale
    assert abs(float(jnp.mean(rounded[:-1])) - 0.3) < 0.002  # nearest would be biased by half a step (0.0024)


def test_int8_convolution_per_example_and_channel_forward_and_backward():
    k = jax.random.split(jax.random.PRNGKey(1), 2)
    x, w = jax.random.normal(k[0], (4, 10, 10, 8)), 0.1 * jax.random.normal(k[1], (3, 3, 8, 16))
    conv = lambda x, w: lax.conv_general_dilated(x, w, (2, 2), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
    params = jax.make_jaxpr(conv)(x, w).eqns[0].params
    assert _rel(int8_conv(x, w, params, jnp.float32), conv(x, w)) < 0.03
    ref = jax.grad(lambda x, w: jnp.sum(jnp.sin(conv(x, w))), (0, 1))(x, w)
    got = jax.grad(lambda x, w: jnp.sum(jnp.sin(int8_conv(x, w, params, jnp.float32))), (0, 1))(x, w)
    assert max(_rel(g, r) for g, r in zip(got, ref)) < 0.04
    jaxpr = jax.make_jaxpr(jax.grad(lambda x, w: jnp.sum(int8_conv(x, w, params, jnp.float32)), (0, 1)))(x, w)
    ops = matmul_ops(jaxpr)
    assert len(ops) == 3 and all(m.int8 for m in ops) and sum(m.backward for m in ops) == 2


# ----------------------------------------------------------------------------- where autocast puts it


def test_pinned_linen_lm_every_projection_int8_forward_and_backward_attention_out():
    tokens = jnp.zeros((4, 8), jnp.int32)
    e = precision.explain(PinnedLM(LMConfig(width=32)), tokens, policy="mixed_int8", int8=EVERY)
    by = {m.path: m for m in e.modules}
    assert by["head"].int8_flops == by["head"].total_flops > 0
    assert by["block_0/Dense_0"].fp8_recipe == "row and column scales"
    attention = "block_0/MultiHeadDotProductAttention_0"
    assert by[attention].int8_flops == 0 < by[attention].total_flops  # q.k^T and probabilities.v: bf16
    assert all(by[f"{attention}/{p}"].int8_share == 1.0 for p in ("query", "key", "value", "out"))
    assert "int8 covers" in e.int8_coverage and e.half_share == 1.0 and not e.uncovered
    assert "matmul/conv FLOPs with int8 operands" in str(e)


def test_min_size_and_rules_keep_matmuls_out_and_say_why():
    tokens = jnp.zeros((4, 8), jnp.int32)
    e = precision.explain(PinnedLM(LMConfig(width=32)), tokens, policy="mixed_int8")  # default min_size 128
    assert e.int8_share == 0 and "below int8 min_size 128" in e.int8_coverage
    ruled = precision.explain(PinnedLM(LMConfig(width=32)), tokens, policy="mixed_int8", int8=EVERY,
                              rules=[["head", "bf16"], ["LayerNorm", "f32"]])
    head = {m.path: m for m in ruled.modules}["head"]
    assert head.int8_flops == 0 and head.not_fp8_reason == "a rule keeps it out of int8"


def test_nnx_scan_remat_and_resnet_reach_int8():
    x = jnp.ones((8, 16))
    nnx_e = precision.explain(PinnedNNXMLP(16, 32, 4, rngs=nnx.Rngs(0)), x, policy="mixed_int8", int8=EVERY)
    assert nnx_e.int8_share == 1.0
    scanned = precision.explain(ScannedLM(), jnp.zeros((2, 8), jnp.int32), policy="mixed_int8", int8=EVERY)
    assert scanned.int8_share == 1.0
    resnet = precision.explain(PinnedResNet(), jnp.ones((2, 8, 8, 3)), policy="mixed_int8", int8=EVERY, train=True)
    assert resnet.int8_share == 1.0 and {m.fp8_recipe for m in resnet.modules if "Conv" in m.path} == {
        "convolution: per-example and per-channel scales"}


def test_hugging_face_flax_gpt2_reaches_int8():
    from helpers import flax_transformers

    transformers = flax_transformers()
    cfg = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=16)
    module = transformers.FlaxGPT2LMHeadModel(cfg, _do_init=False).module
    e = precision.explain(module, jnp.zeros((2, 8), jnp.int32), jnp.ones((2, 8), jnp.int32),
                          jnp.arange(8)[None].repeat(2, 0), policy="mixed_int8", int8=EVERY)
    assert e.int8_share > 0.8 and not e.uncovered


def test_autocast_function_grads_track_float32_and_bf16_backward_has_no_int8():
    k = jax.random.split(jax.random.PRNGKey(2), 3)
    w1, w2, x = 0.05 * jax.random.normal(k[0], (64, 128)), 0.05 * jax.random.normal(k[1], (128, 32)), \
        jax.random.normal(k[2], (32, 64))
    loss = lambda w1, w2: jnp.mean(jnp.tanh(x @ w1) @ w2)  # noqa: E731
    ref = jax.grad(loss, (0, 1))(w1, w2)
    for options, backward_int8 in ((EVERY, 4), ({"min_size": 0, "backward": "bf16"}, 0)):
        fn = precision.autocast(loss, "mixed_int8", int8=options)
        got = jax.grad(fn, (0, 1))(w1, w2)
        assert max(_rel(g, r) for g, r in zip(got, ref)) < 0.03
        ops = matmul_ops(jax.make_jaxpr(jax.grad(fn, (0, 1)))(w1, w2))
        assert sum(m.int8 for m in ops if m.backward) == backward_int8


def test_a_params_int8_gradient_is_made_in_the_fallback_dtype_or_reduce_dtype():
    # as mixed_bf16's matmul makes it on the cast weight: a float32 weight gradient would be written and
    # read at twice the bytes (on a TPU, 1.7 ms a layer at Llama-7B's width); reduce_dtype still decides
    k = jax.random.split(jax.random.PRNGKey(3), 2)
    w, x = 0.05 * jax.random.normal(k[0], (64, 128)), jax.random.normal(k[1], (32, 64))
    loss = lambda w: jnp.mean(jnp.tanh(x @ w))  # noqa: E731

    def bf16_weight_gradient(**kw) -> bool:  # a bf16 value of the weight's shape in the gradient's program
        text = str(jax.make_jaxpr(jax.grad(precision.autocast(loss, "mixed_int8", int8=EVERY, **kw)))(w))
        return "bf16[64,128] = " in text

    assert bf16_weight_gradient() and not bf16_weight_gradient(reduce_dtype="f32")
    grad = jax.grad(precision.autocast(loss, "mixed_int8", int8=EVERY))(w)
    assert grad.dtype == jnp.float32 and _rel(grad, jax.grad(loss)(w)) < 0.03


def test_compute_in_int8_region_and_policy_rules_into_int8():
    def fn(x, w):
        with precision.compute_in("int8"):
            return x @ w
    x, w = jnp.ones((128, 128)), jnp.ones((128, 128))
    ops = matmul_ops(jax.make_jaxpr(precision.autocast(fn, "mixed_bf16"))(x, w))
    assert [m.int8 for m in ops] == [True]
    ruled = precision.explain(PinnedLM(LMConfig(width=32)), jnp.zeros((4, 8), jnp.int32), policy="mixed_bf16",
                              int8=EVERY, rules=[["head", "compute=int8"]])
    assert {m.path for m in ruled.modules if m.int8_flops} == {"head"}


# ----------------------------------------------------------------------------- the config


def test_config_keys_reach_the_options_and_bad_values_say_so():
    from train.config import ConfigError, from_dict

    config = from_dict({"precision": {"policy": "mixed_int8", "int8": {"backward": "bf16", "min_size": 0,
                                                                        "stochastic_rounding": True}}})
    assert config.precision.int8.options() == precision.Int8Options("bf16", True, 0, False)
    with pytest.raises(ConfigError, match="precision.int8.backward"):
        from_dict({"precision": {"policy": "mixed_int8", "int8": {"backward": "fp8"}}})


# ----------------------------------------------------------------------------- training


def test_a_small_lm_trains_under_int8_to_the_loss_of_bf16_and_keeps_the_state_as_it_was():
    import optax

    from train import create_train_state, make_train_step
    from train.models import GPT

    tokens = np.tile(np.arange(16), (16, 3))[:, :17]  # a learnable sequence: next token = token + 1
    batch = {"inputs": jnp.asarray(tokens[:, :-1]), "labels": jnp.asarray(tokens[:, 1:])}
    losses, states = {}, {}
    for name, policy, options in (("bf16", "mixed_bf16", None), ("int8", "mixed_int8", EVERY)):
        model = GPT(vocab_size=16, block_size=16, num_layers=1, num_heads=2, d_model=32)
        state = create_train_state(model, policy, optax.adamw(3e-3), jax.random.PRNGKey(0), batch["inputs"][:1],
                                   int8=options)
        step = make_train_step(task="language_model")
        for _ in range(120):
            state, metrics = step(state, batch)
        losses[name], states[name] = float(metrics["loss"]), state
    assert losses["bf16"] < 0.1 and losses["int8"] < 0.1, losses
    assert abs(losses["int8"] - losses["bf16"]) < 0.05, losses
    same = lambda a, b: jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)  # noqa: E731
    assert same(states["int8"].model_state, states["bf16"].model_state)  # nothing kept: checkpoints as bf16's


def test_stochastic_rounding_steps_are_deterministic():
    k = jax.random.split(jax.random.PRNGKey(3), 2)
    w, x = 0.05 * jax.random.normal(k[0], (64, 32)), jax.random.normal(k[1], (16, 64))
    fn = precision.autocast(lambda w: jnp.mean(jnp.tanh(x @ w) ** 2), "mixed_int8",
                            int8={"min_size": 0, "stochastic_rounding": True})
    grad = jax.jit(jax.grad(fn))
    nearest = jax.grad(precision.autocast(lambda w: jnp.mean(jnp.tanh(x @ w) ** 2), "mixed_int8", int8=EVERY))(w)
    assert jnp.array_equal(grad(w), grad(w)) and not jnp.array_equal(grad(w), nearest)


# ----------------------------------------------------------------------------- the doctor


def test_the_doctor_names_a_module_whose_int8_inputs_round_to_zero_and_verifies_a_bf16_rule():
    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(32, name="out")(nn.relu(nn.Dense(32, name="inner")(x)))

    x = jax.random.normal(jax.random.PRNGKey(0), (16, 32)).at[:, 3].mul(1e3)  # one outlier feature per row
    d = precision.diagnose(MLP(), x, policy="mixed_int8", loss_fn=lambda y: jnp.mean(y ** 2), int8=EVERY)
    problem = [p for p in d.findings.problems if p.kind == "int8"][0]  # the worst first
    assert problem.path == "inner" and problem.pass_ == "forward" and problem.share > 0.5
    assert "round to zero in int8" in problem.detail
    fix = next(r for r in d.recommendations if r.problem == problem)
    assert "[inner, p=f32,c=bf16,o=f32]" in fix.summary
    plain = jax.random.normal(jax.random.PRNGKey(0), (16, 32))
    healthy = precision.diagnose(MLP(), plain, policy="mixed_int8", loss_fn=lambda y: jnp.mean(y ** 2), verify=False,
                                 int8=EVERY)
    assert not [p for p in healthy.findings.problems if p.kind == "int8"]


def test_int8_parity_tabulates_runs_against_bf16(tmp_path):
    import json

    from benchmarks import int8_parity

    for variant, loss, accuracy in (("mixed_bf16", 2.0, 0.5), ("mixed_int8", 2.02, 0.49)):
        workdir = tmp_path / "shakespeare_gpt" / variant
        workdir.mkdir(parents=True)
        (workdir / "summary.json").write_text(json.dumps({"steps": 600, "eval": {"loss": loss, "accuracy": accuracy},
                                                          "loss_scale": {"skipped_steps": 0}}))
    result = int8_parity.collect(tmp_path, measure=False)
    (int8,) = [r for r in result["rows"] if r["variant"] == "mixed_int8"]
    assert abs(int8["vs_bf16"] - 0.01) < 1e-9 and abs(int8["accuracy_vs_bf16"] + 0.01) < 1e-9
    assert "precision.policy=mixed_int8" in int8["command"]
    assert "| shakespeare_gpt | mixed_int8 | 600 | 2.0200 | +1.00% |" in int8_parity.markdown(result)
