"""FP8 matmuls (``mixed_fp8``): the policy, the scaled product, where autocast puts
it (forward and backward) in the project's GPT and a user's pinned NNX LM,
delayed scaling's state through training, accumulation, resume and skips."""

import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings, strategies as st
from jax import lax

import precision
from helpers import assert_bitwise_equal, saved_state
from precision.autocast import fp8_matmul as f8
from precision.autocast.program import matmul_ops
from train import create_train_state, make_train_step, run
from train.config import from_dict
from train.data import load_synthetic
from train.models import GPT, MLP

ROOT = Path(__file__).resolve().parent.parent
E4M3, E5M2 = np.dtype(jnp.float8_e4m3fn), np.dtype(jnp.float8_e5m2)
DOT = (((1,), (0,)), ((), ()))


# ----------------------------------------------------------------------------- policy


def test_f8_is_a_compute_dtype_with_a_16_bit_fallback():
    p = precision.get_policy("mixed_fp8")
    assert p.fp8 and p.compute_dtype == jnp.bfloat16 and p.param_dtype == p.output_dtype == jnp.float32
    assert str(p) == "p=f32,c=f8/bf16,o=f32" and precision.get_policy(str(p)) == p
    assert precision.get_policy("params=f32,compute=fp8/f16,output=f32").compute_dtype == jnp.float16
    assert precision.get_policy("c=float8") == precision.Policy("f32", "f8", "bf16")
    assert not precision.get_policy("mixed_bf16").fp8
    for bad, words in [("f8", "compute dtype for matmuls only"), ("params=f8", "param must be"),
                       ("output=fp8", "output must be"), ("compute=f8/", "fallback dtype")]:
        with pytest.raises(precision.PolicyError, match=words):
            precision.get_policy(bad)


def test_fp8_options_validate_and_come_from_dicts():
    assert precision.fp8_options() == precision.Fp8Options("current", 16, 1024)
    assert precision.fp8.as_fp8_options({"scaling": "Delayed", "history": 4}).delayed
    assert precision.fp8.as_fp8_options({"scaling": "rowwise", "attention": True}).rowwise
    for bad in [dict(scaling="sometimes"), dict(history=0), dict(min_size=-1), dict(min_size=1.5),
                dict(attention="yes")]:
        with pytest.raises(precision.PolicyError):
            precision.fp8_options(**bad)
    with pytest.raises(precision.PolicyError, match="unknown option"):
        precision.fp8.as_fp8_options({"margin": 1})


# ----------------------------------------------------------------------------- the scaled product


def test_scales_are_powers_of_two_that_bring_amax_near_the_format_maximum():
    for amax in [1e-6, 0.3, 1.0, 448.0, 7e4]:
        s = float(f8.scale_for(jnp.float32(amax), jnp.float32(amax), E4M3))
        assert np.log2(s) == int(np.log2(s)) and 224 < amax * s <= 448


def test_zeros_give_zeros_and_non_finite_operands_give_nan():
    x, w = jnp.zeros((4, 8)), jnp.ones((8, 3))
    np.testing.assert_array_equal(f8.scaled_dot(x, w, DOT, jnp.float32), 0.0)
    grads = jax.grad(lambda x, w: f8.scaled_dot(x, w, DOT, jnp.float32).sum(), (0, 1))(x, w)
    assert all(bool(jnp.isfinite(g).all()) for g in grads)
    for bad in (jnp.inf, jnp.nan):
        y = f8.scaled_dot(jnp.ones((4, 8)).at[1, 2].set(bad), w, DOT, jnp.float32)
        assert bool(jnp.isnan(y).all())  # never clipped to a finite value: the step is skipped


def test_delayed_scaling_saturates_a_value_past_its_history_and_records_it():
    hist = f8.Histories(jnp.array([1.0, 0.5]), jnp.array([1.0, 0.0]), jnp.array([1.0, 0.0]))
    x = jnp.ones((2, 8)).at[0, 0].set(1000.0)  # the history says 1: 1000 saturates at 448 / scale
    w = jnp.eye(8)
    y = f8.scaled_dot(x, w, DOT, jnp.float32, hist)
    assert float(y[0, 0]) == 448.0 / 256 and bool(jnp.isfinite(y).all())
    new = jax.grad(lambda h: f8.scaled_dot(x, w, DOT, jnp.float32, h).sum())(hist)
    np.testing.assert_array_equal(new.lhs, [1000.0, 1.0])  # rolled: newest first, oldest dropped
    np.testing.assert_array_equal(new.rhs, [1.0, 1.0])
    np.testing.assert_array_equal(new.grad, [1.0, 1.0])
    np.testing.assert_array_equal(f8.roll_history(jnp.array([2.0, 1.0]), jnp.float32(jnp.inf)), [2.0, 1.0])


def _dims(draw):
    batch, lc, lf, rf = (draw(st.integers(0, n)) for n in (2, 2, 2, 2))
    sizes = draw(st.lists(st.integers(1, 4), min_size=batch + lc + lf + rf, max_size=batch + lc + lf + rf))
    b, c, l, r = sizes[:batch], sizes[batch:batch + lc], sizes[batch + lc:batch + lc + lf], sizes[batch + lc + lf:]
    lhs_axes = draw(st.permutations(range(batch + lc + lf)))
    rhs_axes = draw(st.permutations(range(batch + lc + rf)))
    lhs_shape, rhs_shape = [0] * len(lhs_axes), [0] * len(rhs_axes)
    for i, n in enumerate(b + c + l):
        lhs_shape[lhs_axes[i]] = n
    for i, n in enumerate(b + c + r):
        rhs_shape[rhs_axes[i]] = n
    dims = ((tuple(lhs_axes[batch:batch + lc]), tuple(rhs_axes[batch:batch + lc])),
            (tuple(lhs_axes[:batch]), tuple(rhs_axes[:batch])))
    return tuple(lhs_shape), tuple(rhs_shape), dims


@settings(max_examples=30, deadline=None)
@given(st.data())
def test_the_backward_products_are_the_transposes_of_any_dot_general(data):
    lhs_shape, rhs_shape, dims = _dims(data.draw)
    rng = np.random.default_rng(0)
    x, w = (jnp.asarray(rng.normal(size=s), jnp.float32) for s in (lhs_shape, rhs_shape))
    y, vjp = jax.vjp(lambda a, b: lax.dot_general(a, b, dims), x, w)
    g = jnp.asarray(rng.normal(size=y.shape), jnp.float32)
    dx, dw = vjp(g)
    np.testing.assert_allclose(f8.transpose_lhs(g, w, dims, x.ndim, jnp.float32), dx, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(f8.transpose_rhs(g, x, dims, w.ndim, jnp.float32), dw, rtol=1e-5, atol=1e-5)


def test_fp8_products_are_close_to_float32_forward_and_backward():
    rng = np.random.default_rng(1)
    x, w = jnp.asarray(rng.normal(size=(64, 96)), jnp.float32), jnp.asarray(rng.normal(size=(96, 32)), jnp.float32)
    g = jnp.asarray(rng.normal(size=(64, 32)), jnp.float32)
    rel = lambda a, b: float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))  # noqa: E731
    assert rel(f8.scaled_dot(x, w, DOT, jnp.float32), x @ w) < 0.05  # E4M3: 3 mantissa bits, errors average out
    dx, dw = jax.grad(lambda x, w: (f8.scaled_dot(x, w, DOT, jnp.float32) * g).sum(), (0, 1))(x, w)
    assert rel(dx, g @ w.T) < 0.1 and rel(dw, x.T @ g) < 0.1  # E5M2: 2 mantissa bits


# ----------------------------------------------------------------------------- where autocast puts it


def _step_matmuls(state, batch):
    jaxpr = jax.make_jaxpr(make_train_step(donate=False, task="language_model" if batch["inputs"].ndim == 2
                                           and batch["labels"].ndim == 2 else "classification"))(state, batch)
    return matmul_ops(jaxpr)


def _lm_batch(vocab=32, length=16, batch=4):
    tokens = np.random.default_rng(0).integers(0, vocab, size=(batch, length + 1))
    return {"inputs": jnp.asarray(tokens[:, :-1]), "labels": jnp.asarray(tokens[:, 1:])}


def _check_fp8_at_or_above(ops, min_size, expect_small):
    big = [m for m in ops if m.primitive == "dot_general" and m.fp8]
    assert any(not m.backward for m in big) and any(m.backward for m in big)
    assert all(m.dtype == E4M3 for m in big if not m.backward)
    assert all(m.dtype in (E4M3, E5M2) for m in big if m.backward) and any(m.dtype == E5M2 for m in big)
    small = [m for m in ops if m.primitive == "dot_general" and not m.fp8]
    assert bool(small) == expect_small
    assert all(m.dtype == jnp.bfloat16 for m in small), {m.dtype for m in small}


@pytest.mark.parametrize("min_size", [0, 32])
def test_every_matmul_of_the_project_gpt_step_at_or_above_min_size_is_fp8(min_size):
    model = GPT(vocab_size=32, block_size=16, num_layers=2, num_heads=2, d_model=64)
    batch = _lm_batch()
    state = create_train_state(model, "mixed_fp8", optax.adamw(1e-3), jax.random.PRNGKey(0), batch["inputs"][:1],
                               fp8=precision.fp8_options(min_size=min_size, attention=True))
    # min_size 32: attention's head-size (32) contractions stay, the 16-token products (M=16) fall back to bf16
    _check_fp8_at_or_above(_step_matmuls(state, batch), min_size, expect_small=min_size > 0)
    assert all(leaf.dtype == jnp.float32 for leaf in jax.tree_util.tree_leaves(state.params))  # masters


def test_a_users_pinned_float32_nnx_lm_gets_fp8_matmuls_forward_and_backward():
    sys.path.insert(0, str(ROOT / "examples" / "user_models"))
    try:
        from nnx_lm import LM
    finally:
        sys.path.pop(0)
    from flax import nnx

    model = LM(vocab_size=32, max_len=16, width=32, heads=2, layers=1, rngs=nnx.Rngs(0))
    batch = _lm_batch()
    state = create_train_state(model, "mixed_fp8", optax.adamw(1e-3), jax.random.PRNGKey(0), batch["inputs"][:1],
                               fp8={"min_size": 0, "scaling": "delayed"})
    _check_fp8_at_or_above(_step_matmuls(state, batch), 0, expect_small=True)  # attention's products: bf16
    explanation = precision.explain(precision.with_policy(LM(32, 16, 32, 2, 1, rngs=nnx.Rngs(0)), "mixed_fp8",
                                                          fp8={"min_size": 0}), batch["inputs"])
    assert 0.5 < explanation.fp8_share < 1.0 and "fp8" in str(explanation)
    assert explanation.fp8_coverage.endswith("(the rest: attention stays out of fp8)")
    every = precision.explain(precision.with_policy(LM(32, 16, 32, 2, 1, rngs=nnx.Rngs(0)), "mixed_fp8",
                                                    fp8={"min_size": 0, "attention": True}), batch["inputs"])
    assert every.fp8_share == pytest.approx(1.0)


def test_explain_gives_fp8_shares_and_why_a_matmul_is_not_fp8():
    import flax.linen as nn

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.Dense(64, dtype=jnp.float32)(x)
            x = nn.Conv(4, (3,))(x[..., None]).reshape(x.shape[0], -1)
            return nn.Dense(8, name="head")(nn.Dense(64, name="mid")(x))

    x = jnp.ones((64, 64))
    e = precision.explain(Net(), x, policy="mixed_fp8", rules=[("mid", "bf16")], fp8={"min_size": 16})
    by_path = {m.path: m for m in e.modules}
    assert by_path["Dense_0"].fp8_share == 1.0
    assert "rule" in by_path["mid"].not_fp8_reason and by_path["mid"].fp8_share == 0.0
    assert "min_size" in by_path["head"].not_fp8_reason  # N = 8 < 16
    assert "dot_general only" in by_path["Conv_0"].not_fp8_reason
    assert 0 < e.fp8_share < 1 and "not fp8 because" in e.table()
    assert e.fp8_coverage.startswith(f"fp8 covers {100 * e.fp8_share:.0f}% of matmul FLOPs (the rest: ")
    assert "below fp8 min_size 16" in e.fp8_coverage and e.fp8_coverage in e.table()
    none = precision.explain(Net(), x, policy="mixed_fp8", fp8={"min_size": 4096})
    assert none.fp8_coverage == ("fp8 covers 0% of matmul FLOPs (fp8 takes dot_general only; below fp8 min_size "
                                 "4096); min_size=64 would take the largest matmuls")


def test_a_run_that_computes_nothing_in_fp8_says_so_in_its_header_summary_and_explain(tmp_path):
    """Issue 39 (2, 3): the default experiment under mixed_fp8 (every matmul below min_size 1024)
    trained as bf16 without a word, and --explain ignored precision.fp8.*."""
    from train.cli import main

    base = ["configs/default.yaml", "precision.policy=mixed_fp8", "steps=2", "progress=false",
            "inference_dtypes=[]", "checkpoint_every=0", "eval_every=0"]
    out = _run_cli(main, [*base, f"workdir={tmp_path / 'a'}"])
    assert out.count("fp8 covers 0% of matmul FLOPs (all below fp8 min_size 1024)") == 2  # header and summary
    assert json.loads((tmp_path / "a" / "summary.json").read_text())["notes"] == [
        "fp8 covers 0% of matmul FLOPs (all below fp8 min_size 1024); min_size=128 would take the largest matmuls"]
    out = _run_cli(main, [*base, f"workdir={tmp_path / 'b'}", "precision.fp8.min_size=0"])
    assert out.count("fp8 covers 100% of matmul FLOPs") == 2
    explained = _run_cli(main, ["configs/default.yaml", "precision.policy=mixed_fp8", "precision.fp8.min_size=0",
                                "--explain"])
    assert "fp8 covers 100% of matmul FLOPs" in explained and "below fp8 min_size" not in explained


def _run_cli(main, argv):
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(argv) == 0
    return out.getvalue()


# ----------------------------------------------------------------------------- delayed scaling in training

DATA = load_synthetic(num_train=256, num_test=32, input_shape=(16,), num_classes=4, seed=0)


def _mlp_state(fp8, policy="mixed_fp8"):
    return create_train_state(MLP(hidden=(32,), num_classes=4), policy, optax.adam(1e-2), jax.random.PRNGKey(0),
                              DATA.sample_input(1), fp8=fp8)


def test_delayed_histories_live_in_the_state_and_roll_each_step():
    state = _mlp_state({"scaling": "delayed", "history": 3, "min_size": 0})
    hist = state.model_state[precision.FP8_COLLECTION]
    assert set(hist) == {"Dense_0", "Dense_1"} and set(hist["Dense_0"]["dot_general_0"]) == {"lhs", "rhs", "grad"}
    step = make_train_step(donate=False)
    amaxes = []
    for i in range(4):
        state, metrics = step(state, jax.device_put(DATA.train_batch(i, 32, seed=0)))
        amaxes.append(float(state.model_state[precision.FP8_COLLECTION]["Dense_0"]["dot_general_0"]["rhs"][0]))
        assert metrics["grads_finite"]
    last = np.asarray(state.model_state[precision.FP8_COLLECTION]["Dense_0"]["dot_general_0"]["rhs"])
    np.testing.assert_array_equal(last, amaxes[::-1][:3])  # the weight's amax of the last 3 steps, newest first


def test_accumulation_keeps_the_largest_amax_of_the_micro_batches():
    fp8 = {"scaling": "delayed", "history": 2, "min_size": 0}
    batch = DATA.train_batch(0, 32, seed=0)
    whole, _ = make_train_step(donate=False, accum_steps=2)(_mlp_state(fp8), jax.device_put(batch))
    lhs = []
    for i in range(2):  # the strided micro-batches the step makes: rows i, i + 2, ...
        micro = jax.tree_util.tree_map(lambda x: x[i::2], batch)
        state, _ = make_train_step(donate=False)(_mlp_state(fp8), jax.device_put(micro))
        lhs.append(float(state.model_state[precision.FP8_COLLECTION]["Dense_0"]["dot_general_0"]["lhs"][0]))
    got = whole.model_state[precision.FP8_COLLECTION]["Dense_0"]["dot_general_0"]["lhs"]
    assert float(got[0]) == max(lhs) and float(got[1]) == 0.0


def test_a_non_finite_step_is_skipped_params_and_histories_kept():
    state = _mlp_state({"scaling": "delayed", "history": 2, "min_size": 0})
    step = make_train_step(donate=False)
    state, _ = step(state, jax.device_put(DATA.train_batch(0, 32, seed=0)))
    batch = DATA.train_batch(1, 32, seed=0)
    batch["inputs"] = batch["inputs"].copy()
    batch["inputs"][3, 5] = np.inf
    after, metrics = step(state, jax.device_put(batch))
    assert not bool(metrics["grads_finite"])
    assert_bitwise_equal(jax.device_get(after.params), jax.device_get(state.params))
    assert_bitwise_equal(jax.device_get(after.model_state), jax.device_get(state.model_state))


TINY_LM = {
    "steps": 6, "log_every": 2, "eval_every": 6, "checkpoint_every": 3, "progress": False, "inference_dtypes": [],
    "model": {"name": "gpt", "num_layers": 1, "num_heads": 2, "d_model": 32},
    "data": {"name": "synthetic_text", "num_classes": 16, "seq_len": 16, "batch_size": 8, "eval_batches": 1},
    "optimizer": {"name": "adamw", "lr": 3e-3},
    "accum_steps": 2,
    "precision": {"policy": "mixed_fp8", "fp8": {"scaling": "delayed", "history": 4, "min_size": 0}},
}


def test_delayed_state_is_checkpointed_and_a_resumed_run_matches_bit_for_bit(tmp_path):
    config = lambda workdir, **kw: from_dict({**json.loads(json.dumps(TINY_LM)), "workdir": str(workdir), **kw})  # noqa: E731
    run(config(tmp_path / "straight"))
    run(config(tmp_path / "resumed", steps=3))
    run(config(tmp_path / "resumed"))
    step_a, a = saved_state(tmp_path / "straight")
    step_b, b = saved_state(tmp_path / "resumed")
    assert step_a == step_b == 6
    fp8 = a["model_state"][precision.FP8_COLLECTION]
    assert all(float(np.max(h)) > 0 for h in jax.tree_util.tree_leaves(fp8))
    assert_bitwise_equal(a, b)


def test_fp8_parity_reports_the_gap_to_bf16(tmp_path):
    from benchmarks import fp8_parity

    for experiment in fp8_parity.EXPERIMENTS:
        for variant, loss in zip(fp8_parity.VARIANTS, (2.0, 2.02, 2.05, 2.06, 2.04)):
            workdir = tmp_path / fp8_parity._slug(experiment) / fp8_parity._slug(variant)
            workdir.mkdir(parents=True)
            (workdir / "summary.json").write_text(json.dumps(
                {"steps": 600, "eval": {"loss": loss}, "loss_scale": {"skipped_steps": 0}}))
    result = fp8_parity.collect(tmp_path)
    fp8 = next(r for r in result["rows"] if r["variant"] == "mixed_fp8")
    assert fp8["vs_bf16"] == pytest.approx(2.05 / 2.02 - 1) and fp8["vs_fp32"] == pytest.approx(0.025)
    assert "| mixed_fp8 |" in fp8_parity.markdown(result)


@pytest.mark.parametrize("options,scaling", [(dict(scan_layers=True), "delayed"), (dict(remat="full"), "delayed"),
                                             (dict(scan_layers=True), "rowwise")])
def test_fp8_reaches_scanned_and_rematerialized_layers_and_keeps_activations_16_bit(options, scaling):
    from precision.autocast.program import iter_ops

    model = GPT(vocab_size=32, block_size=16, num_layers=2, num_heads=2, d_model=64, **options)
    batch = _lm_batch()
    state = create_train_state(model, "mixed_fp8", optax.adamw(1e-3), jax.random.PRNGKey(0), batch["inputs"][:1],
                               fp8={"min_size": 0, "scaling": scaling, "attention": True})  # delayed in a loop
    # body: scaled currently
    jaxpr = jax.make_jaxpr(make_train_step(donate=False, task="language_model"))(state, batch)
    _check_fp8_at_or_above(matmul_ops(jaxpr), 0, expect_small=False)
    forward = [op for op in iter_ops(jaxpr) if op.primitive == "dot_general" and not op.backward]
    assert forward and all(op.out_dtypes == (np.dtype(jnp.bfloat16),) for op in forward)  # not float32 activations


def test_a_small_lm_trains_under_fp8_to_the_loss_of_float32():
    tokens = np.tile(np.arange(16), (16, 3))[:, :17]  # a learnable sequence: next token = token + 1
    batch = {"inputs": jnp.asarray(tokens[:, :-1]), "labels": jnp.asarray(tokens[:, 1:])}
    losses = {}
    for policy in ("fp32", "mixed_fp8"):
        model = GPT(vocab_size=16, block_size=16, num_layers=1, num_heads=2, d_model=32)
        state = create_train_state(model, policy, optax.adamw(3e-3), jax.random.PRNGKey(0), batch["inputs"][:1],
                                   fp8={"min_size": 0})
        step = make_train_step(task="language_model")
        for _ in range(150):
            state, metrics = step(state, batch)
            assert bool(metrics["grads_finite"])
        losses[policy] = float(metrics["loss"])
    assert losses["fp32"] < 0.1  # it learned the sequence
    assert losses["mixed_fp8"] < 0.1 and abs(losses["mixed_fp8"] - losses["fp32"]) < 0.05, losses
