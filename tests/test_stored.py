"""Precision for stored state: bfloat16 masters (stochastic rounding, Kahan, nearest),
optimizer state in bfloat16 for any optax optimizer, the policy grammar that names
them, the bytes they save, and resume bit for bit."""

import json

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import precision
import train
from helpers import saved_state
from precision.stored import ACCUM_STREAM, accumulate, kahan_add, stochastic_round, step_key, stored_in
from train.config import from_dict
from train.data import load_synthetic
from train.models import MLP

BF16 = jnp.bfloat16


def test_stochastic_rounding_is_unbiased_deterministic_and_keeps_non_finite_values():
    x = jnp.full((200_000,), 1.0 + 2.0 ** -10, jnp.float32)  # an eighth of a bfloat16 ulp above 1
    r = stochastic_round(x, step_key(jnp.uint32(0))).astype(jnp.float32)
    assert set(np.unique(np.asarray(r))) == {1.0, 1.0078125}
    assert abs(float(r.mean()) - (1.0 + 2.0 ** -10)) < 2e-5
    chex.assert_trees_all_equal(r, stochastic_round(x, step_key(jnp.uint32(0))).astype(jnp.float32))
    assert not np.array_equal(np.asarray(r), np.asarray(stochastic_round(x, step_key(jnp.uint32(1)))))
    special = jnp.array([jnp.inf, -jnp.inf, jnp.nan, 0.0, 1.5], jnp.float32)
    out = np.asarray(stochastic_round(special, step_key(jnp.uint32(0))).astype(jnp.float32))
    assert np.isposinf(out[0]) and np.isneginf(out[1]) and np.isnan(out[2]) and out[3] == 0 and out[4] == 1.5


def test_kahan_carries_what_rounding_lost_into_the_next_step():
    value, comp = jnp.ones((), BF16), jnp.zeros((), BF16)
    for _ in range(100):
        value, comp = kahan_add(value, jnp.float32(-1e-3), comp)
    assert abs(float(value) + float(comp) - 0.9) < 1e-3


@pytest.mark.parametrize("rounding,moves", [("stochastic", True), ("kahan", True), ("nearest", False)])
def test_bfloat16_masters_keep_small_updates_unless_rounded_to_nearest(rounding, moves):
    """The seeds' rounding problem, measured: 100 updates of a tenth of an ulp against 1.0."""
    params = {"w": jnp.ones((256,), BF16), "b": jnp.zeros((4,), jnp.float32)}
    tx = precision.mixed_precision(optax.sgd(1e-3), precision.NoOpLossScale(), master_dtype=BF16,
                                   master_rounding=rounding, skip_with="select")
    state = tx.init(params)
    assert state.master_params is None  # bfloat16 params are their own masters: no copy

    @jax.jit
    def step(p, s):
        u, s = tx.update({"w": jnp.ones((256,), BF16), "b": jnp.ones((4,), jnp.float32)}, s, p)
        return optax.apply_updates(p, u), s

    for _ in range(100):
        params, state = step(params, state)
    assert params["w"].dtype == BF16 and params["b"].dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(params["b"]), -0.1, rtol=1e-5)
    mean = float(params["w"].astype(jnp.float32).mean())
    assert (abs(mean - 0.9) < 0.004) if moves else mean == 1.0, mean


def test_a_skipped_step_leaves_bfloat16_masters_and_their_state_unchanged():
    params = {"w": jnp.ones((8,), BF16)}
    tx = precision.mixed_precision(optax.adam(1e-2), precision.DynamicLossScale(2.0 ** 4), master_dtype=BF16,
                                   master_rounding="kahan", state_dtype=BF16, skip_with="select")
    state = tx.init(params)
    updates, after = tx.update({"w": jnp.full((8,), jnp.inf, BF16)}, state, params)
    chex.assert_trees_all_equal(optax.apply_updates(params, updates), params)
    chex.assert_trees_all_equal(after.stored_masters, state.stored_masters)
    chex.assert_trees_all_equal(after.inner_state, state.inner_state)


@pytest.mark.parametrize("make", [lambda: optax.adam(1e-2), lambda: optax.adamw(1e-2, weight_decay=0.1),
                                  lambda: optax.lion(1e-3), lambda: optax.sgd(1e-2, momentum=0.9)],
                         ids=["adam", "adamw", "lion", "sgd-momentum"])
def test_any_optax_optimizer_stores_its_state_in_bfloat16_and_updates_like_float32(make):
    params = {"w": jax.random.normal(jax.random.key(0), (64, 32)), "b": jnp.zeros((32,))}
    lean, full = stored_in(make(), BF16), make()
    lean_state, full_state = lean.init(params), full.init(params)
    floats = [x for x in jax.tree_util.tree_leaves(lean_state.inner_state) if jnp.issubdtype(x.dtype, jnp.floating)]
    assert floats and all(x.dtype == BF16 for x in floats if x.ndim)
    for i in range(20):
        grads = jax.tree_util.tree_map(lambda p, i=i: jax.random.normal(jax.random.key(i), p.shape), params)
        u_lean, lean_state = lean.update(grads, lean_state, params)
        u_full, full_state = full.update(grads, full_state, params)
    for a, b in zip(jax.tree_util.tree_leaves(u_lean), jax.tree_util.tree_leaves(u_full)):
        a, b = np.asarray(a), np.asarray(b)  # off by more than 5% of the largest update: under 1% of values
        assert np.mean(np.abs(a - b) > 0.05 * np.abs(b).max()) < 0.01  # (Lion: a sign flipped near zero)


def test_8_bit_blocks_round_trip_without_bias_and_take_about_a_byte_per_value():
    from precision.quantized import dequantize, quantize

    x = jax.random.normal(jax.random.key(0), (64, 300)) * jnp.logspace(-4, 1, 300)  # five decades in a row
    one = quantize(x, step_key(jnp.uint32(0)))
    assert one.codes.dtype == jnp.float8_e4m3fn and one.codes.shape == (75, 256) and one.scales.shape == (75,)
    assert float(jnp.linalg.norm(dequantize(one) - x) / jnp.linalg.norm(x)) < 0.1
    mean = jnp.stack([dequantize(quantize(x, step_key(jnp.uint32(i)))) for i in range(64)]).mean(0)
    assert float(jnp.linalg.norm(mean - x) / jnp.linalg.norm(x)) < 0.015  # the error averages out: no bias
    assert float(jnp.max(jnp.abs(dequantize(quantize(jnp.zeros((4096,)), step_key(jnp.uint32(0))))))) == 0.0


def test_the_policy_names_master_and_state_dtypes_and_parses_back():
    lean = precision.get_policy("lean_bf16")
    assert (lean.param_dtype, lean.master_dtype, lean.master_rounding, lean.state_dtype) == (
        np.dtype(BF16), np.dtype(BF16), "stochastic", np.dtype(BF16))
    assert str(lean) == "p=bf16,c=bf16,o=f32,m=bf16/sr,s=bf16" and precision.get_policy(str(lean)) == lean
    spelled = precision.get_policy("params=bf16,compute=bf16,output=f32,master=bf16/kahan,opt=bf16")
    assert spelled.master_rounding == "kahan" and precision.get_policy(str(spelled)) == spelled
    assert precision.get_policy("p=f32,c=f16,m=f32,s=f32") == precision.get_policy("p=f32,c=f16")  # the defaults
    assert precision.get_policy("mixed_bf16").master_dtype is None
    assert str(precision.get_policy("lean_int8")) == "p=bf16,c=bf16,o=f32,m=bf16/sr,s=int8"
    accum = precision.get_policy("params=f32,compute=bf16,output=f32,grad_accum=bf16")
    assert accum.accum_dtype == np.dtype(BF16) and str(accum) == "p=f32,c=bf16,o=f32,a=bf16"
    assert precision.get_policy(str(accum)) == accum and precision.get_policy("mixed_bf16").accum_dtype is None
    assert precision.get_policy("p=f32,c=bf16,a=f32") == precision.get_policy("p=f32,c=bf16")


@pytest.mark.parametrize("spec,message", [
    ("p=bf16,m=f16", "master=f16: master dtypes are f32 or bf16"),
    ("p=bf16,opt=f16", "state=f16: state dtypes are f32 or bf16"),
    ("p=f32,m=bf16", "master=bf16 makes bf16 params their own masters, but params are f32"),
    ("p=bf16,m=bf16/round", "unknown master rounding (valid: sr, kahan, nearest) 'round'"),
    ("p=f32,c=f16,accum=f16", "accum=f16: accum dtypes are f32 or bf16"),
])
def test_a_stored_dtype_that_cannot_work_gets_one_clear_line(spec, message):
    with pytest.raises(precision.PolicyError, match=None) as e:
        precision.get_policy(spec)
    assert message in str(e.value) and "\n" not in str(e.value)


DATA = load_synthetic(num_train=512, num_test=64, input_shape=(16,), num_classes=4, seed=0)


def _trained(policy, steps=120):
    state = train.create_train_state(MLP(hidden=(64, 64), num_classes=4), policy, optax.adamw(3e-3),
                                     jax.random.PRNGKey(0), DATA.sample_input(1))
    step = train.make_train_step()
    for i in range(steps):
        state, metrics = step(state, DATA.train_batch(i, 32, seed=0))
    n = sum(x.size for x in jax.tree_util.tree_leaves(state.params))
    stored = sum(x.nbytes for x in jax.tree_util.tree_leaves((state.params, state.opt_state)))
    return float(metrics["loss"]), stored / n


def test_lean_policies_take_half_and_a_third_of_mixed_bf16s_bytes_and_train_like_it():
    mixed, mixed_bytes = _trained("mixed_bf16")
    lean, lean_bytes = _trained("lean_bf16")
    int8, int8_bytes = _trained("lean_int8")
    nearest, _ = _trained("p=bf16,c=bf16,o=f32,m=bf16/nearest,s=bf16")
    assert mixed_bytes == pytest.approx(12.0, abs=0.01) and lean_bytes < 6.1  # LayerNorm params stay float32
    assert int8_bytes < 4.8  # 16x64 kernels are under MIN_SIZE: bfloat16 moments (4.03 at GPT-2 scale)
    assert abs(lean - mixed) <= 0.1 * mixed and abs(int8 - mixed) <= 0.1 * mixed and nearest > lean, (
        mixed, lean, int8, nearest)


@pytest.mark.parametrize("policy,accum_steps,header", [
    ("params=bf16,compute=bf16,output=f32,master=bf16/kahan,opt=bf16", 1,
     "train state: 8.0 bytes/param (params 2.1, masters 1.9, optimizer 4.0)"),  # float32 norm params: no buffer
    ("lean_int8", 1, "train state: 4.4 bytes/param (params 2.1, masters 0.0, optimizer 2.4)"),  # small arrays: bf16
    ("params=bf16,compute=bf16,output=f32,master=bf16,opt=bf16,accum=bf16", 2,
     "train state: 8.1 bytes/param (params 2.1, masters 0.0, optimizer 4.0, gradient accumulation 2.0 during a "
     "step; accum=f32 would take 4.0)"),
])
def test_a_lean_run_from_a_config_says_its_bytes_and_resumes_bit_for_bit(tmp_path, capsys, policy, accum_steps,
                                                                         header):
    spec = {"steps": 6, "log_every": 2, "eval_every": 6, "checkpoint_every": 3, "progress": False,
            "accum_steps": accum_steps,
            "inference_dtypes": [], "model": {"name": "mlp", "hidden": [64]},
            "data": {"name": "digits", "batch_size": 16, "eval_batch_size": 100, "eval_batches": 1},
            "optimizer": {"name": "adamw", "lr": 3e-3}, "precision": {"policy": policy}}
    config = lambda workdir, **kw: from_dict({**json.loads(json.dumps(spec)), "workdir": str(workdir), **kw})  # noqa: E731
    train.run(config(tmp_path / "straight"))
    shown = [line for line in capsys.readouterr().out.splitlines() if line.startswith("train state:")]
    assert shown and shown[0].startswith(header) and shown[0].endswith(f"policy {precision.get_policy(policy)}"), shown
    train.run(config(tmp_path / "resumed", steps=3))
    train.run(config(tmp_path / "resumed"))
    (step_a, a), (step_b, b) = saved_state(tmp_path / "straight"), saved_state(tmp_path / "resumed")
    assert step_a == step_b == 6
    assert all(x.dtype == BF16 for x in jax.tree_util.tree_leaves(a["params"]) if x.ndim == 2)
    assert any(x.dtype == jnp.float8_e4m3fn for x in jax.tree_util.tree_leaves(a["opt_state"])) == (policy == "lean_int8")
    chex.assert_trees_all_equal(a, b)


def test_a_pinned_float32_nnx_model_gets_bfloat16_params_and_state_under_lean_bf16_and_trains_like_mixed():
    """The NNX LM pins ``dtype=float32, param_dtype=float32``: lean_bf16 must still store its kernels and
    moments in bfloat16 (not leave them float32 quietly) and train to mixed_bf16's loss."""
    import sys

    from flax import nnx

    from helpers import ROOT

    sys.path.insert(0, str(ROOT / "examples" / "user_models"))
    import nnx_lm

    tokens = jax.random.randint(jax.random.key(0), (8, 17), 0, 32)
    batch = {"inputs": tokens[:, :-1], "labels": tokens[:, 1:]}

    def trained(policy):
        state = train.create_train_state(nnx_lm.LM(32, 16, 32, 4, 2, rngs=nnx.Rngs(0)), policy, optax.adamw(3e-3),
                                         jax.random.PRNGKey(0), batch["inputs"][:1])
        step = train.make_train_step(task="language_model")
        for _ in range(40):
            state, metrics = step(state, batch)
        return state, float(metrics["loss"])

    (lean, lean_loss), (_, mixed_loss) = trained("lean_bf16"), trained("mixed_bf16")
    kernels = [x for x in jax.tree_util.tree_leaves(lean.params) if x.ndim == 2]
    assert kernels and all(x.dtype == BF16 for x in kernels)
    moments = jax.tree_util.tree_leaves(precision.find_mixed_precision_state(lean.opt_state).inner_state)
    assert any(x.dtype == BF16 and x.ndim == 2 for x in moments)
    assert abs(lean_loss - mixed_loss) <= 0.02 * mixed_loss, (lean_loss, mixed_loss)


def test_accumulate_adds_in_float32_and_rounds_a_bfloat16_buffer_stochastically():
    """1000 micro-batch gradients of 1e-3 onto 1.0: a bfloat16 sum rounded to nearest never
    moves (the bfloat16 ulp at 1 is 2**-7); stochastic rounding lands near 2.0, as float32."""
    grads = {"w": jnp.full((256,), 1e-3, jnp.float32)}
    totals = {"f32": {"w": jnp.ones((256,), jnp.float32)}, "bf16": {"w": jnp.ones((256,), BF16)}}
    nearest = jnp.ones((256,), BF16)
    for i in range(1000):
        totals = {k: accumulate(t, grads, step_key(jnp.uint32(7), i, ACCUM_STREAM)) for k, t in totals.items()}
        nearest = (nearest.astype(jnp.float32) + grads["w"]).astype(BF16)
    assert totals["f32"]["w"].dtype == jnp.float32 and totals["bf16"]["w"].dtype == BF16
    np.testing.assert_allclose(np.asarray(totals["f32"]["w"]), 2.0, rtol=1e-4)  # 1000 float32 additions
    assert float(jnp.max(nearest)) == 1.0
    assert abs(float(jnp.mean(totals["bf16"]["w"].astype(jnp.float32))) - 2.0) < 0.01


def _accumulated(policy, steps):
    state = train.create_train_state(MLP(hidden=(64, 64), num_classes=4), policy, optax.adam(3e-3),
                                     jax.random.PRNGKey(0), DATA.sample_input(1))
    step = train.make_train_step(accum_steps=4)
    carried = [line for line in step.lower(state, DATA.train_batch(0, 64, seed=0)).as_text().splitlines()
               if "stablehlo.while" in line]  # the scan over micro-batches: its carry holds the sums
    for i in range(steps):
        state, metrics = step(state, DATA.train_batch(i, 64, seed=0))
    return state, float(metrics["loss"]), carried[0]


def test_gradients_accumulated_in_bfloat16_take_half_the_buffer_and_train_like_float32():
    # (Bit-exact resume with a bfloat16 sum: test_a_lean_run_from_a_config_says_its_bytes_and_resumes_bit_for_bit.)
    _, f32_loss, f32_carry = _accumulated("mixed_bf16", 50)
    _, bf16_loss, bf16_carry = _accumulated("p=f32,c=bf16,o=f32,accum=bf16", 50)
    assert abs(bf16_loss - f32_loss) <= 0.05 * f32_loss, (f32_loss, bf16_loss)
    # The hidden kernel in the carry: the float32 param the micro-batches read, and the sum.
    assert (f32_carry.count("tensor<64x64xf32>"), f32_carry.count("tensor<64x64xbf16>")) == (2, 0), f32_carry
    assert (bf16_carry.count("tensor<64x64xf32>"), bf16_carry.count("tensor<64x64xbf16>")) == (1, 1), bf16_carry


def test_the_memory_check_counts_the_states_own_bytes_so_lean_policies_and_adafactor_fit_where_adam_does_not():
    """Before its optimizer state is allocated, a train state is checked against the memory from its own
    shapes and dtypes (params, masters, optimizer state, one step's gradients), not a float32 Adam guess."""
    from train.experiment.builders import build_train_state
    from train.config import ConfigError, load_config
    from train.experiment.loop import build_experiment

    from helpers import ROOT

    config = load_config(ROOT / "configs" / "default.yaml", ["progress=false"])
    data, _, model = build_experiment(config)
    count = sum(x.size for x in jax.tree_util.tree_leaves(jax.eval_shape(
        lambda: build_train_state(config, model, data, memory=(0, ""))[0].params)))
    memory = (count * 10, "in this test")
    expected = (r"model 'mlp': its train state under mixed_f16 with adamw needs 1.38 MB \(16 bytes/param: params 4, "
                r"optimizer 8, gradients 4\), more than the 860 kB of memory in this test; its options: "
                r"hidden=\[256, 256\]")
    with pytest.raises(ConfigError, match=expected):
        build_train_state(config, model, data, memory=memory)
    for overrides in (["precision.policy=lean_int8"], ["precision.policy=lean_bf16"], ["optimizer.name=adafactor"]):
        state, _ = build_train_state(load_config(ROOT / "configs" / "default.yaml", overrides), model, data,
                                     memory=memory)
        total = precision.state_bytes(state.params, state.opt_state)["total"]
        assert total < 8, (overrides, total)
