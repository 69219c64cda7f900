"""The jitted train and eval steps: accumulation, donation, f32 loss, skipping, eval sums."""

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import precision
from train import (create_train_state, cross_entropy, evaluate, make_eval_step, make_train_step,
                   summarize_eval)
from train.data import load_dataset
from train.models import MLP, ResNet
from precision.optim import _first_nonfinite_leaf

DIGITS = load_dataset("digits")


def _state(policy="fp32", model=None, loss_scale="auto", lr=1e-2):
    model = model or MLP(hidden=(32,), num_classes=10)
    return create_train_state(model, policy, optax.sgd(lr, momentum=0.9), jax.random.PRNGKey(0),
                              DIGITS.sample_input(1), loss_scale=loss_scale)


def _batch(n=32, index=0):
    return DIGITS.train_batch(index, n, seed=0)


def _leaves(state):
    return [np.asarray(x) for x in jax.tree_util.tree_leaves(state.params)]


@pytest.mark.parametrize("policy,atol", [("fp32", 1e-6), ("mixed_f16", 1e-5)])  # f16 rounds per micro-batch
def test_accumulation_matches_one_large_batch(policy, atol):
    one = make_train_step(accum_steps=1, donate=False)
    four = make_train_step(accum_steps=4, donate=False)
    a, b = _state(policy), _state(policy)
    for i in range(3):
        a, ma = one(a, _batch(32, i))
        b, mb = four(b, _batch(32, i))
        np.testing.assert_allclose(float(ma["loss"]), float(mb["loss"]), rtol=1e-4)
        np.testing.assert_allclose(float(ma["grad_norm"]), float(mb["grad_norm"]), rtol=1e-3)
    for x, y in zip(_leaves(a), _leaves(b)):
        np.testing.assert_allclose(x, y, rtol=1e-4, atol=atol)


def test_accumulation_checks_finiteness_once_per_effective_batch():
    step = make_train_step(accum_steps=4, donate=False)
    state = _state("mixed_f16")
    batch = _batch(32)
    batch["inputs"] = batch["inputs"].copy()
    batch["inputs"][9] = 1e30  # one example of the second micro-batch overflows f16
    new, metrics = step(state, batch)
    assert not bool(metrics["grads_finite"]) and int(metrics["skipped_steps"]) == 1
    for x, y in zip(_leaves(state), _leaves(new)):
        np.testing.assert_array_equal(x, y)
    assert float(new.loss_scale.loss_scale) == float(state.loss_scale.loss_scale) / 2


def test_accumulation_rejects_an_indivisible_batch():
    with pytest.raises(ValueError, match="not divisible by accum_steps=3"):
        make_train_step(accum_steps=3)(_state(), _batch(32))


def test_train_step_donates_the_state_and_reports_metrics():
    step = make_train_step(learning_rate_fn=optax.constant_schedule(1e-2))
    state = _state("mixed_f16")
    old_leaf = jax.tree_util.tree_leaves(state.params)[0]
    state, metrics = step(state, _batch())
    assert old_leaf.is_deleted()
    assert set(metrics) >= {"loss", "loss_scale", "grads_finite", "grad_norm", "skipped_steps", "learning_rate"}
    assert metrics["loss"].dtype == jnp.float32 and int(state.step) == 1
    assert float(metrics["loss_scale"]) == 2.0 ** 15
    np.testing.assert_allclose(float(metrics["learning_rate"]), 1e-2)


def test_learning_rate_metric_does_not_advance_on_skipped_steps():
    step = make_train_step(learning_rate_fn=lambda count: 1.0 / (1.0 + count), donate=False)
    state = _state("mixed_f16")
    bad = _batch()
    bad["inputs"] = np.full_like(bad["inputs"], 1e30)
    state, m1 = step(state, bad)  # skipped
    state, m2 = step(state, _batch())
    assert float(m1["learning_rate"]) == float(m2["learning_rate"]) == 1.0


def test_loss_is_computed_in_float32_even_from_float16_logits():
    logits = jnp.array([[60000.0, -60000.0, 0.0]], jnp.float16)
    loss, correct = cross_entropy(logits, jnp.array([1]))
    assert loss.dtype == jnp.float32 and np.isfinite(float(loss[0]))
    np.testing.assert_allclose(float(loss[0]), 120000.0, rtol=1e-3)
    naive = optax.softmax_cross_entropy_with_integer_labels(logits, jnp.array([1]))
    assert not np.isfinite(float(naive[0]))  # why the step casts first


def test_first_nonfinite_leaf_names_the_first_bad_gradient():
    grads = {"a": jnp.ones(3), "b": jnp.array([1.0, jnp.nan]), "c": jnp.array([jnp.inf])}
    assert int(_first_nonfinite_leaf(grads, jnp.array(False))) == 1
    assert int(_first_nonfinite_leaf(grads, jnp.array(True))) == -1


def test_eval_sums_ignore_padding():
    state = _state()
    eval_step = make_eval_step()
    padded = evaluate(eval_step, state, DIGITS.eval_batches(64), "classification")  # 297 = 4*64 + 41
    whole = evaluate(eval_step, state, DIGITS.eval_batches(297), "classification")
    np.testing.assert_allclose(padded["loss"], whole["loss"], rtol=1e-5)
    assert padded["accuracy"] == whole["accuracy"]
    assert summarize_eval({"loss_sum": 2.0, "correct": 1.0, "count": 2.0}, "language_model")["perplexity"] == \
        pytest.approx(np.e)


def test_batchnorm_state_updates_and_stays_float32():
    step = make_train_step(donate=False)
    state = _state("pure_f16", model=ResNet(stage_sizes=(1,), width=4))
    before = jax.tree_util.tree_leaves(state.model_state)
    state, _ = step(state, _batch(16))
    after = jax.tree_util.tree_leaves(state.model_state)
    assert all(x.dtype == jnp.float32 for x in after)
    assert any(not np.array_equal(x, y) for x, y in zip(before, after))


def test_create_train_state_rejects_what_it_cannot_train():
    with pytest.raises(TypeError, match="expected a flax.linen.Module or flax.nnx.Module .*got function"):
        create_train_state(lambda x: x, "fp32", optax.sgd(0.1), jax.random.PRNGKey(0), np.zeros((1, 2), np.float32))
    wrapped = precision.with_policy(MLP(hidden=(4,)), "mixed_bf16")
    with pytest.raises(ValueError, match="differs from the wrapped model"):
        create_train_state(wrapped, "mixed_f16", optax.sgd(0.1), jax.random.PRNGKey(0), DIGITS.sample_input(1))
    state = create_train_state(wrapped, None, optax.sgd(0.1), jax.random.PRNGKey(0), DIGITS.sample_input(1))
    assert str(state.policy) == "p=f32,c=bf16,o=f32"
    assert isinstance(state.loss_scale, precision.NoOpLossScale)  # auto: bf16 needs no scaling


def test_create_train_state_starts_from_given_variables_under_any_policy():
    model, x = ResNet(stage_sizes=(1,), width=4), DIGITS.sample_input(2)
    trained = create_train_state(model, "fp32", optax.sgd(0.1), jax.random.PRNGKey(0), x)
    variables = {"params": trained.params, **trained.model_state}
    o2 = create_train_state(model, "O2", optax.sgd(0.1), jax.random.PRNGKey(1), x, variables=variables)
    conv = o2.params["Conv_0"]["kernel"]
    assert conv.dtype == jnp.float16 and o2.params["BatchNorm_0"]["scale"].dtype == jnp.float32  # norms f32
    np.testing.assert_array_equal(conv, trained.params["Conv_0"]["kernel"].astype(jnp.float16))
    master = precision.find_mixed_precision_state(o2.opt_state).master_params["Conv_0"]["kernel"]
    np.testing.assert_array_equal(master, trained.params["Conv_0"]["kernel"].astype(jnp.float16).astype(jnp.float32))
    with pytest.raises(ValueError, match="do not match the model at batch_stats/BatchNorm_0/mean"):
        create_train_state(model, "O2", optax.sgd(0.1), jax.random.PRNGKey(1), x,
                           variables={"params": trained.params})


def test_learning_rate_is_a_metric_only_with_a_learning_rate_fn():
    """docs/python-api.md says so (issue 39, 15)."""
    import optax

    from train import create_train_state, make_train_step
    from train.models import MLP

    x = jnp.ones((4, 8))
    state = create_train_state(MLP(hidden=(8,), num_classes=3), "fp32", optax.sgd(0.1), jax.random.PRNGKey(0), x[:1])
    batch = {"inputs": x, "labels": jnp.zeros(4, jnp.int32)}
    assert "learning_rate" not in make_train_step(donate=False)(state, batch)[1]
    _, metrics = make_train_step(donate=False, learning_rate_fn=lambda step: 0.1)(state, batch)
    assert float(metrics["learning_rate"]) == pytest.approx(0.1)


@settings(max_examples=20, deadline=None)  # each example compiles its shapes: 40 took 25 s of CPU
@given(st.integers(1, 5), st.integers(2, 40), st.integers(0, 2 ** 31 - 1),
       st.sampled_from(["normal", "ties", "bf16", "masked"]))
def test_cross_entropy_is_optaxs_loss_and_argmaxs_correctness_in_one_pass(rows, vocab, seed, kind):
    """The built-in loss reads the maximum its log-sum-exp takes for correctness (no pass of
    its own over the logits): the same loss and gradient as optax's, and ``argmax == label``
    exactly, ties included (the first largest logit is the prediction)."""
    rng = np.random.default_rng(seed)
    logits = rng.standard_normal((rows, vocab)).astype(np.float32)
    if kind == "ties":  # few distinct values: the largest is often shared
        logits = np.round(logits).astype(np.float32)
    elif kind == "bf16":
        logits = np.asarray(jnp.asarray(logits, jnp.bfloat16).astype(jnp.float32))
    labels = rng.integers(0, vocab, rows)
    if kind == "masked":  # a vocabulary masked with -inf, the label's logit kept
        keep = rng.random((rows, vocab)) < 0.5
        keep[np.arange(rows), labels] = True
        logits = np.where(keep, logits, -np.inf).astype(np.float32)
    loss, correct = jax.jit(cross_entropy)(jnp.asarray(logits), jnp.asarray(labels))
    expected = optax.softmax_cross_entropy_with_integer_labels(jnp.asarray(logits), jnp.asarray(labels))
    np.testing.assert_allclose(np.asarray(loss), np.asarray(expected), rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(correct), np.argmax(logits, -1) == labels)
    grad = jax.grad(lambda x: cross_entropy(x, jnp.asarray(labels))[0].sum())(jnp.asarray(logits))
    reference = jax.grad(lambda x: optax.softmax_cross_entropy_with_integer_labels(x, jnp.asarray(labels)).sum())(
        jnp.asarray(logits))
    np.testing.assert_allclose(np.asarray(grad), np.asarray(reference), rtol=1e-5, atol=1e-7)


def test_cross_entropy_reads_the_logits_in_two_passes_and_its_gradient_is_one_expression():
    """The forward reduces the logits in two passes (the maximum and its first position in one
    reduction, then the sum of exponentials: not max, log-sum-exp and argmax a pass each), and
    the gradient is ``softmax - one_hot``: no scatter (the label's gather transposed), which XLA
    cannot fuse with the reductions that read the gradient, so it would write the float32
    gradient out and read it back (3.3 GB each way at GPT-2-small's vocabulary)."""
    logits, labels = jnp.zeros((4, 16, 128), jnp.bfloat16), jnp.zeros((4, 16), jnp.int32)

    def loss(x):
        per_token, correct = cross_entropy(x, labels)
        return per_token.mean(), correct.mean()

    forward = jax.jit(loss).lower(logits).as_text()
    over_logits = [line for line in forward.splitlines() if "stablehlo.reduce" in line and "4x16x128" in line]
    assert len(over_logits) == 2, over_logits
    first_maximum, total = over_logits
    assert "4x16x128xf32>, tensor<4x16x128xi32>" in first_maximum and "applies stablehlo.add" in total
    backward = jax.jit(jax.grad(lambda x: loss(x)[0])).lower(logits).as_text()
    assert "scatter" not in backward and "gather" not in backward
    assert jax.grad(lambda x: loss(x)[0])(logits).dtype == jnp.bfloat16


def _exponentials_per_logit(jaxpr, shape, folding=False) -> int:
    """How many exponentials ``jaxpr`` evaluates per logit: an ``exp`` over the logits' shape
    counts one, and so does one in the computation of a reduction over logits-shaped operands
    (``folding``: applied once per logit it folds in); nested programs are counted too."""
    count = 0
    for eqn in jaxpr.eqns:
        count += eqn.primitive.name == "exp" and (folding or eqn.outvars[0].aval.shape == shape)
        inner = folding or (eqn.primitive.name == "reduce" and eqn.invars[0].aval.shape == shape)
        count += sum(_exponentials_per_logit(getattr(v, "jaxpr", v), shape, inner)
                     for v in eqn.params.values() if hasattr(v, "eqns"))
    return count


def _on(platform, monkeypatch):
    """The cross-entropy's reduction as lowered for ``platform`` (``"tpu"``: one pass; else two), here."""
    import precision.losses

    monkeypatch.setattr(precision.losses, "platform_dependent",
                        lambda *args, tpu, default: (tpu if platform == "tpu" else default)(*args))


@pytest.mark.parametrize("platform", ["gpu", "tpu"])
def test_cross_entropy_evaluates_one_exponential_per_logit_forward_and_one_more_for_the_gradient(platform, monkeypatch):
    """The forward's sum of exponentials is against the maximum already found (two passes) or
    scales only the smaller side's sum (a TPU's one pass): one ``exp`` a logit, where the
    online-softmax pass shipped until 2026-11-30 (both sides rescaled) evaluated two, slower on an
    H200 (1.685 ms against 1.223 at GPT-2 small's logits); the gradient's softmax is the one more."""
    _on(platform, monkeypatch)
    logits, labels = jnp.zeros((4, 16, 128), jnp.bfloat16), jnp.zeros((4, 16), jnp.int32)
    forward = jax.make_jaxpr(lambda x: cross_entropy(x, labels))(logits).jaxpr
    assert _exponentials_per_logit(forward, logits.shape) == 1
    grad = jax.make_jaxpr(jax.grad(lambda x: cross_entropy(x, labels)[0].mean()))(logits).jaxpr
    assert _exponentials_per_logit(grad, logits.shape) == 2


def test_lowered_for_a_tpu_the_cross_entropy_reads_the_logits_once_and_elsewhere_twice():
    """A TPU program folds maximum, sum and first position into one reduction over the logits (XLA
    fuses it with the head's output there, :func:`precision.cross_entropy`); a GPU or CPU program
    reduces them twice. Lowered here for each platform (``jax.export``: no TPU needed)."""
    logits, labels = jnp.zeros((4, 16, 128), jnp.float32), jnp.zeros((4, 16), jnp.int32)

    def over_logits(platform):
        exported = jax.export.export(jax.jit(lambda x: cross_entropy(x, labels)[0]), platforms=(platform,))(logits)
        return [line for line in exported.mlir_module().splitlines() if "stablehlo.reduce" in line and "4x16x128" in line]

    [fold] = over_logits("tpu")
    assert fold.count("tensor<4x16x128x") == 3, fold  # logits, their sums of 1, positions
    assert len(over_logits("cuda")) == len(over_logits("cpu")) == 2


@pytest.mark.parametrize("platform", ["gpu", "tpu"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_cross_entropy_is_a_float64_references_loss_and_correctness_with_ties_and_minus_inf(dtype, platform,
                                                                                            monkeypatch):
    """Loss and correctness against numpy in float64 (logsumexp from the row's maximum, the
    first largest logit the prediction) on random logits, rows of tied maxima, rows with -inf
    logits (the label's kept, and the label's -inf: an infinite loss) and a row all -inf (NaN,
    predicted position 0); as a TPU computes it (one pass) and as a GPU does (two)."""
    _on(platform, monkeypatch)
    rng = np.random.default_rng(7)
    logits = np.asarray(jnp.asarray(3 * rng.standard_normal((4, 6, 300)), dtype).astype(jnp.float32), np.float64)
    labels = rng.integers(0, 300, (4, 6))
    logits[1] = np.round(logits[1])  # few distinct values: the maximum tied
    logits[1, 0, [4, 9, 250]] = 20.0
    labels[1, 0], labels[1, 1] = 4, 9  # the first of tied maxima is correct, a later one not
    logits[1, 1, [4, 9]] = 20.0
    masked = rng.random((6, 300)) < 0.7
    masked[np.arange(6), labels[2]] = False
    logits[2][masked] = -np.inf
    logits[3, 0, labels[3, 0]] = -np.inf
    logits[3, 1] = -np.inf
    peak = logits.max(-1, keepdims=True)
    shift = np.where(np.isfinite(peak), peak, 0.0)
    with np.errstate(invalid="ignore", divide="ignore"):
        log_total = shift[..., 0] + np.log(np.exp(logits - shift).sum(-1))
        expected = log_total - np.take_along_axis(logits, labels[..., None], -1)[..., 0]
    loss, correct = jax.jit(cross_entropy)(jnp.asarray(logits, dtype), jnp.asarray(labels))
    assert loss.dtype == jnp.float32 and correct.dtype == jnp.bool_
    np.testing.assert_allclose(np.asarray(loss, np.float64), expected, rtol=2e-6, atol=1e-6)
    assert np.isposinf(loss[3, 0]) and np.isnan(loss[3, 1]) and np.isfinite(np.asarray(loss)[:3]).all()
    np.testing.assert_array_equal(np.asarray(correct), np.argmax(logits, -1) == labels)
    assert bool(correct[1, 0]) and not bool(correct[1, 1]) and bool(correct[3, 1]) == (labels[3, 1] == 0)


class _PinnedConvNet(nn.Module):
    """Written as people write them: every layer pinned to float32, BatchNorm, no train keyword
    (``use_running_average`` fixed), a convolution kernel (4-D: its own reduction in the check)."""

    @nn.compact
    def __call__(self, x):
        x = nn.Conv(8, (3, 3), dtype=jnp.float32, name="conv")(x.reshape(x.shape[0], 8, 8, 1))
        x = nn.relu(nn.BatchNorm(use_running_average=False, dtype=jnp.float32, name="norm")(x))
        x = nn.Dense(32, dtype=jnp.float32, name="hidden")(x.reshape(x.shape[0], -1))
        return nn.Dense(10, dtype=jnp.float32, name="out")(nn.relu(x))


def test_the_accelerators_one_pass_check_trains_as_the_per_leaf_check_and_skips_what_it_finds(monkeypatch):
    """``skip_with="select"`` lowered for an accelerator checks gradients with
    precision.grad_norms.check_gradients; run here on a CPU (the platform choice replaced), a
    pinned-dtype conv net with BatchNorm under mixed_bf16 trains step for step as the per-leaf
    check does (same norm, same params), and a non-finite batch is skipped bit for bit with
    the culprit named."""
    import precision.optim

    def run(accelerator_check):
        with monkeypatch.context() as patch:
            if accelerator_check:
                patch.setattr(precision.optim, "platform_dependent", lambda *a, cpu, default: default(*a))
            state = create_train_state(_PinnedConvNet(), "mixed_bf16", optax.adam(1e-2), jax.random.key(0),
                                       _batch(2)["inputs"], skip_with="select")
            step = make_train_step(donate=False)
            norms = []
            for i in range(5):
                state, metrics = step(state, _batch(32, i))
                norms.append(float(metrics["grad_norm"]))
            bad = _batch(32, 5)
            bad["inputs"] = np.array(bad["inputs"])
            bad["inputs"][0, 0] = np.inf
            skipped, metrics = step(state, bad)
            return state, skipped, norms, metrics

    ours, ours_skipped, ours_norms, ours_bad = run(True)
    plain, _, plain_norms, _ = run(False)
    np.testing.assert_allclose(ours_norms, plain_norms, rtol=1e-5)
    for a, b in zip(_leaves(ours), _leaves(plain)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert not bool(ours_bad["grads_finite"]) and int(ours_bad["nonfinite_leaf"]) >= 0
    chex.assert_trees_all_equal(ours_skipped.params, ours.params)
