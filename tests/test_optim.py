"""The mixed-precision optax wrapper: unscale, skip, master weights, clipping, accumulation."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import precision
from precision import DynamicLossScale, NoOpLossScale, StaticLossScale, mixed_precision


def params_f32():
    return {"w": jnp.array([1.0, -0.0, 0.0, -2.5]), "b": jnp.array([0.5, -1.0])}


def bits(tree):
    return jax.tree_util.tree_map(lambda x: np.asarray(x).view(np.uint8 if x.dtype.itemsize == 1 else
                                                              {2: np.uint16, 4: np.uint32, 8: np.uint64}[x.dtype.itemsize]),
                                  tree)


def step(tx, params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state


class SkipTest(chex.TestCase):

    @chex.variants(with_jit=True, without_jit=True)
    def test_non_finite_step_leaves_params_and_inner_state_bit_identical(self):
        for skip_with in precision.optim.SKIP_STRATEGIES:
            self._check_skip(skip_with)
            self._check_skip(skip_with, half=True)

    def _check_skip(self, skip_with, half=False):
        tx = mixed_precision(optax.adam(1e-2), DynamicLossScale(2.0 ** 10, period=3), skip_with=skip_with)
        params = params_f32()
        if half:
            params = jax.tree_util.tree_map(lambda x: x.astype(jnp.float16), params)
        state = tx.init(params)
        run = self.variant(lambda p, s, g: step(tx, p, s, g))
        good = jax.tree_util.tree_map(lambda x: jnp.full_like(x, 2.0 ** 10 * 1e-3), params)
        params, state = run(params, state, good)  # a real step first, so the adam state is non-trivial
        for poison in (jnp.inf, -jnp.inf, jnp.nan):
            bad = {"w": good["w"].at[2].set(poison), "b": good["b"]}
            new_params, new_state = run(params, state, bad)
            chex.assert_trees_all_equal(bits(new_params), bits(params))
            chex.assert_trees_all_equal(bits(new_state.inner_state), bits(state.inner_state))
            chex.assert_trees_all_equal(bits(new_state.master_params), bits(state.master_params))
            assert not bool(new_state.grads_finite)
            assert float(new_state.loss_scale.loss_scale) == float(state.loss_scale.loss_scale) / 2
            assert int(new_state.loss_scale.skipped_steps) == int(state.loss_scale.skipped_steps) + 1
            state = new_state
        assert np.signbit(params["w"][1])  # -0.0 survived three skipped steps

    @chex.variants(with_jit=True, without_jit=True)
    def test_finite_step_matches_plain_optax_on_unscaled_grads(self):
        scale = 2.0 ** 12
        tx = mixed_precision(optax.adam(1e-2), StaticLossScale(scale))
        ref = optax.adam(1e-2)
        params = params_f32()
        grads = {"w": jnp.array([0.1, -0.2, 0.3, 0.4]), "b": jnp.array([1e-3, -5.0])}
        scaled = jax.tree_util.tree_map(lambda g: g * scale, grads)
        p1, s1 = self.variant(lambda p, s, g: step(tx, p, s, g))(params, tx.init(params), scaled)
        p2, _ = step(ref, params, ref.init(params), grads)
        chex.assert_trees_all_close(p1, p2, rtol=1e-6)
        assert bool(s1.grads_finite)
        np.testing.assert_allclose(s1.grad_norm, optax.global_norm(grads), rtol=1e-6)


class MasterWeightTest(chex.TestCase):

    def test_seed_004_rounding_small_updates_vanish_in_f16_but_accumulate_with_master(self):
        """Updates of 1e-4 on a weight of 1.0: below half an f16 ulp at 1.0 (2**-11)."""
        lr, grad, steps = 1e-4, 1.0, 200
        half = {"w": jnp.ones(3, jnp.float16)}
        grads = {"w": jnp.full(3, grad, jnp.float16)}

        plain = optax.sgd(lr)
        p, s = half, plain.init(half)
        for _ in range(steps):
            p, s = step(plain, p, s, grads)
        assert float(p["w"][0]) == 1.0  # every update rounded away

        tx = mixed_precision(optax.sgd(lr), NoOpLossScale())
        p, s = half, tx.init(half)
        run = jax.jit(lambda p, s: step(tx, p, s, grads))
        for _ in range(steps):
            p, s = run(p, s)
        assert p["w"].dtype == jnp.float16
        expected = 1.0 - steps * lr * grad
        np.testing.assert_allclose(np.asarray(s.master_params["w"]), expected, rtol=1e-5)
        assert float(p["w"][0]) == float(jnp.float16(expected))  # the rounded master

    def test_half_params_land_exactly_on_rounded_master(self):
        key = jax.random.key(0)
        for dtype in (jnp.float16, jnp.bfloat16):
            params = {"w": jax.random.normal(key, (512,)).astype(dtype) * 3}
            tx = mixed_precision(optax.adam(3e-3), NoOpLossScale())
            state = tx.init(params)
            for i in range(5):
                grads = {"w": jax.random.normal(jax.random.fold_in(key, i), (512,)).astype(dtype)}
                params, state = step(tx, params, state, grads)
                np.testing.assert_array_equal(np.asarray(params["w"]),
                                              np.asarray(state.master_params["w"].astype(dtype)))

    def test_optimizer_state_is_f32_with_half_params_and_tiny_grads_do_not_break_adam(self):
        params = {"w": jnp.ones(4, jnp.float16)}
        tx = mixed_precision(optax.adam(1e-3), NoOpLossScale())
        state = tx.init(params)
        assert all(x.dtype != jnp.float16 for x in jax.tree_util.tree_leaves(state.inner_state))
        grads = {"w": jnp.full(4, 1e-5, jnp.float16)}  # squared: 1e-10, zero in f16 (optax#1754)
        new_params, state = step(tx, params, state, grads)
        assert bool(state.grads_finite)
        assert np.isfinite(np.asarray(new_params["w"], np.float32)).all()
        np.testing.assert_allclose(np.asarray(state.master_params["w"]), 1 - 1e-3, rtol=1e-4)
        # plain optax on f16 params keeps f16 moments: nu underflows to 0.
        plain = optax.adam(1e-3)
        plain_state = plain.init(params)
        _, plain_state = plain.update(grads, plain_state, params)
        assert float(plain_state[0].nu["w"][0]) == 0.0

    def test_master_weights_only_when_needed(self):
        assert mixed_precision(optax.sgd(1.0)).init(params_f32()).master_params is None
        mixed = {"w": jnp.ones(2, jnp.float16), "norm": jnp.ones(2)}
        state = mixed_precision(optax.sgd(1.0)).init(mixed)
        assert all(x.dtype == jnp.float32 for x in jax.tree_util.tree_leaves(state.master_params))
        with pytest.raises(ValueError, match="needs `params`"):
            mixed_precision(optax.sgd(1.0)).update(mixed, state)


class ClippingTest(chex.TestCase):

    @chex.variants(with_jit=True, without_jit=True)
    def test_clipping_sees_unscaled_gradients(self):
        scale = 2.0 ** 10
        grads = {"w": jnp.array([3.0, 4.0, 0.0, 0.0]), "b": jnp.zeros(2)}  # norm 5
        scaled = jax.tree_util.tree_map(lambda g: g * scale, grads)
        params = params_f32()
        reference = optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(1.0))
        expected, _ = step(reference, params, reference.init(params), grads)

        for tx in (mixed_precision(optax.sgd(1.0), StaticLossScale(scale), max_grad_norm=1.0),
                   mixed_precision(optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(1.0)),
                                   StaticLossScale(scale))):
            got, _ = self.variant(lambda p, s, g: step(tx, p, s, g))(params, tx.init(params), scaled)
            chex.assert_trees_all_close(got, expected, rtol=1e-6)
        # Clipped with the wrapper's own norm, its state as with optax's clip: checkpoints restore.
        clipping = mixed_precision(optax.sgd(1.0), StaticLossScale(scale), max_grad_norm=1.0)
        assert (jax.tree_util.tree_structure(clipping.init(params).inner_state)
                == jax.tree_util.tree_structure(reference.init(params)))

        # The wrong composition clips the *scaled* gradients, i.e. by norm 1 / scale.
        wrong = optax.chain(optax.clip_by_global_norm(1.0), mixed_precision(optax.sgd(1.0), StaticLossScale(scale)))
        got, _ = step(wrong, params, wrong.init(params), scaled)
        moved = float(jnp.linalg.norm(got["w"] - params["w"]))
        assert moved == pytest.approx(1.0 / scale, rel=1e-3)  # vs 1.0 when clipping unscaled

    def test_bad_max_grad_norm(self):
        with pytest.raises(ValueError, match="max_grad_norm"):
            mixed_precision(optax.sgd(1.0), max_grad_norm=0)
        with pytest.raises(TypeError, match="loss_scale"):
            mixed_precision(optax.sgd(1.0), loss_scale=2.0)
        with pytest.raises(ValueError, match="skip_with must be one of auto, select, cond"):
            mixed_precision(optax.sgd(1.0), skip_with="where")


class AccumulationTest(chex.TestCase):

    def test_multisteps_scale_fixed_and_one_finiteness_check_per_effective_batch(self):
        scale = 2.0 ** 8
        tx = optax.MultiSteps(mixed_precision(optax.sgd(1.0), DynamicLossScale(scale, period=1000)), every_k_schedule=3)
        params = params_f32()
        state = tx.init(params)
        run = jax.jit(lambda p, s, g: step(tx, p, s, g))
        micro = [jax.tree_util.tree_map(lambda x: jnp.full_like(x, v * scale), params) for v in (0.1, 0.2, 0.3)]

        # finite effective batch: one update by the mean gradient
        p = params
        for i, g in enumerate(micro):
            assert float(precision.current_loss_scale(state).loss_scale) == scale  # fixed across micro-steps
            p, state = run(p, state, g)
            if i < 2:
                chex.assert_trees_all_equal(p, params)
        chex.assert_trees_all_close(p, jax.tree_util.tree_map(lambda x: x - 0.2, params), rtol=1e-6)

        # one overflowing micro-batch: the whole effective batch is skipped, the scale backs off once
        bad = {"w": micro[1]["w"].at[0].set(jnp.inf), "b": micro[1]["b"]}
        q = p
        for g in (micro[0], bad):
            q, state = run(q, state, g)
            assert float(precision.current_loss_scale(state).loss_scale) == scale
        q, state = run(q, state, micro[2])
        chex.assert_trees_all_equal(bits(q), bits(p))
        mp_state = precision.find_mixed_precision_state(state)
        assert float(mp_state.loss_scale.loss_scale) == scale / 2
        assert int(mp_state.loss_scale.skipped_steps) == 1  # one check per effective batch

    def test_find_state_errors_clearly(self):
        with pytest.raises(ValueError, match="found 0"):
            precision.find_mixed_precision_state(optax.adam(1e-3).init(params_f32()))


def test_gradients_whose_norm_overflows_float32_count_as_non_finite():
    tx = mixed_precision(optax.adam(1e-3), NoOpLossScale())
    params = params_f32()
    grads = jax.tree_util.tree_map(lambda x: jnp.full_like(x, 1e20), params)  # finite, norm**2 overflows
    new_params, state = step(tx, params, tx.init(params), grads)
    assert not bool(state.grads_finite)
    chex.assert_trees_all_equal(bits(new_params), bits(params))


def test_gradients_are_unscaled_inside_the_skipped_update_not_before_it():
    # Unscaling every gradient before the skip decision materialises a second copy of
    # the gradients ahead of lax.cond: it measured 1.2x the step time of a small MLP
    # on CPU (benchmarks, loss_scale_overhead_ratio). Only scalars may be scaled outside.
    params = {"w": jnp.ones((64, 32)), "b": jnp.ones((32,))}
    tx = mixed_precision(optax.adam(1e-3), DynamicLossScale(2.0 ** 15), skip_with="cond")
    jaxpr = jax.make_jaxpr(tx.update)(params, tx.init(params), params).jaxpr
    outside = [e for e in jaxpr.eqns if e.primitive.name in ("mul", "div")
               and any(getattr(v.aval, "shape", ()) != () for v in e.outvars)]
    assert not outside, [str(e) for e in outside]
    assert any(e.primitive.name == "cond" for e in jaxpr.eqns)


def test_full_precision_params_are_the_master_copy_when_params_are_half():
    params = {"w": jnp.full((3,), 1.0)}
    half = jax.tree_util.tree_map(lambda x: x.astype(jnp.float16), params)
    tx = mixed_precision(optax.sgd(1.0), NoOpLossScale())
    new_half, state = step(tx, half, tx.init(half), {"w": jnp.full((3,), 2.0 ** -12, jnp.float16)})
    full = precision.full_precision_params(new_half, state)
    assert full["w"].dtype == jnp.float32 and new_half["w"].dtype == jnp.float16
    np.testing.assert_array_equal(full["w"], jnp.full((3,), 1.0 - 2.0 ** -12))  # not representable in f16
    assert precision.full_precision_params(params, tx.init(params)) is params  # float32: no copy


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16])
def test_select_and_cond_skips_take_the_same_steps(dtype):
    """skip_with="select" computes AdamW's updates from the state it selects: a finite step,
    a skipped one (bit-identical to the step before) and the next finite ones match the cond
    strategy (to rounding: XLA fuses the two programs differently)."""
    params = jax.tree_util.tree_map(lambda x: x.astype(dtype), params_f32())
    grads = {"w": jnp.array([0.3, -0.2, 1e-3, 4.0]), "b": jnp.array([1.0, -5.0])}
    bad = {"w": grads["w"].at[1].set(jnp.nan), "b": grads["b"]}
    results = {}
    for skip_with in ("select", "cond"):
        tx = mixed_precision(optax.adamw(1e-2, weight_decay=0.1), DynamicLossScale(2.0 ** 4), skip_with=skip_with)
        run = jax.jit(lambda p, s, g, tx=tx: step(tx, p, s, g))
        p, s = params, tx.init(params)
        history = []
        for g in (grads, bad, grads, grads):
            p, s = run(p, s, jax.tree_util.tree_map(lambda x: (x * 2.0 ** 4).astype(dtype), g))
            history.append((p, s.inner_state, s.master_params))
        chex.assert_trees_all_equal(bits(history[1]), bits(history[0]))  # skipped
        results[skip_with] = [jax.tree_util.tree_map(lambda x: np.asarray(x, np.float64), h) for h in history]
    chex.assert_trees_all_close(results["select"], results["cond"], rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16])
def test_select_skip_updates_donated_state_in_place(dtype):
    """No copy of the optimizer state (or master weights) before the update writes over
    it: the compiled step reads and writes each leaf about as often as plain optax."""
    import functools
    import re

    params = {"w": jnp.ones((256, 64), dtype), "b": jnp.ones((64,), dtype)}
    grads = jax.tree_util.tree_map(lambda p: jnp.ones(p.shape, jnp.float16), params)

    def compiled(tx):
        @functools.partial(jax.jit, donate_argnums=(0, 1))
        def run(p, s, g):
            return step(tx, p, s, g)
        return run.lower(params, tx.init(params), grads).compile()

    ours = compiled(mixed_precision(optax.adamw(1e-3), DynamicLossScale(2.0 ** 10), skip_with="select"))
    assert not re.findall(r"= f(?:32|16)\[256,64\]\{[0-9,]*\} copy\(", ours.as_text())
    if dtype == jnp.float32:
        plain = compiled(optax.adamw(1e-3))
        ratio = ours.cost_analysis()["bytes accessed"] / plain.cost_analysis()["bytes accessed"]
        assert ratio < 1.1, ratio  # + one read of the (f16) gradients for the finiteness check


def test_grad_norm_reports_nan_and_inf_as_they_are():
    tx = mixed_precision(optax.sgd(1.0), NoOpLossScale(), skip_with="select")
    params = params_f32()
    for poison, check in ((jnp.nan, np.isnan), (jnp.inf, np.isposinf), (-jnp.inf, np.isposinf)):
        grads = {"w": jnp.array([1.0, poison, 0.0, 2.0]), "b": jnp.array([0.5, 1.0])}
        _, state = step(tx, params, tx.init(params), grads)
        assert check(float(state.grad_norm)) and int(state.nonfinite_leaf) == 1  # leaves: b, w


def test_the_select_strategy_reduces_small_leaves_together_and_keeps_each_leafs_norm():
    """Small leaves of one size share a reduction (one kernel, not one per leaf); each leaf's
    sum of squares, the global norm and the first non-finite leaf are what per-leaf sums give."""
    from precision.grad_norms import SMALL_LEAF, checked_nonfinite_leaf, leaf_check, leaf_squared_norms

    rng = np.random.default_rng(0)
    shapes = [(SMALL_LEAF + 8,), (8,), (3, 4), (12,), (), (0,), (8,), (2, SMALL_LEAF), (12,)]
    grads = [jnp.asarray(rng.standard_normal(s), jnp.bfloat16 if i % 3 == 0 else jnp.float32)
             for i, s in enumerate(shapes)]
    per_leaf = np.array([np.sum(np.square(np.asarray(g, np.float64))) for g in grads])
    together = jax.jit(lambda g: leaf_squared_norms(g, one_loop=True))
    np.testing.assert_allclose(np.asarray(together(grads)), per_leaf, rtol=1e-5)
    for bad in (1, 6, 7):  # a small leaf sharing its reduction, its twin, a large leaf
        for poison in (jnp.nan, jnp.inf):
            poisoned = list(grads)
            poisoned[bad] = poisoned[bad].at[(0,) * poisoned[bad].ndim].set(poison)
            squares = together(poisoned)
            assert [i for i, s in enumerate(np.asarray(squares)) if not np.isfinite(s)] == [bad]
            check = leaf_check(poisoned, one_loop=True)
            assert int(checked_nonfinite_leaf(check, jnp.array(False))) == bad


def _leaves_for_the_one_pass_check(seed: int) -> list:
    """Leaves as a model's gradients come: matrices of a few widths (one a transpose), convolution kernels,
    vectors, a scalar, an empty leaf, bfloat16 and float32, more of them than one reduction reads."""
    from precision.grad_norms import LEAVES_PER_REDUCTION

    rng = np.random.default_rng(seed)
    shapes = [(40, 24), (24,), (), (0, 3), (24, 40), (7, 24), (3, 5, 24), (1000,), (3, 3, 2, 4)] * 6
    assert len(shapes) > LEAVES_PER_REDUCTION
    leaves = [jnp.asarray(rng.standard_normal(s), jnp.bfloat16 if i % 5 == 0 else jnp.float32)
              for i, s in enumerate(shapes)]
    leaves[4] = jnp.asarray(rng.standard_normal((40, 24)), jnp.float32).T  # a transposed matrix
    return leaves


@pytest.mark.parametrize("seed", [0, 1])
def test_the_one_pass_check_gives_the_global_norm_first_nonfinite_leaf_and_largest_leaf(seed):
    """check_gradients (select on an accelerator) against a sum of squares per leaf: the same
    norm, the first leaf holding a nan or inf wherever it sits, -1 when finite, and -2 - i when
    only the sum of squares overflows (leaf i holding the largest element)."""
    from precision.grad_norms import check_gradients, checked_nonfinite_leaf

    leaves = _leaves_for_the_one_pass_check(seed)
    check = jax.jit(check_gradients)
    expected = sum(float(np.sum(np.square(np.asarray(g, np.float64)))) for g in leaves)
    found = check(leaves)
    np.testing.assert_allclose(float(found.squares), expected, rtol=1e-5)
    assert int(checked_nonfinite_leaf(found, jnp.array(True))) == -1
    assert int(found.first_nonfinite) == -1
    for bad in (0, 4, 6, len(leaves) - 1, 33):
        if leaves[bad].size == 0:
            continue
        for poison in (jnp.nan, jnp.inf, -jnp.inf):
            poisoned = list(leaves)
            poisoned[bad] = poisoned[bad].at[(-1,) * poisoned[bad].ndim].set(poison)
            result = check(poisoned)
            assert not np.isfinite(float(result.squares))
            assert int(checked_nonfinite_leaf(result, jnp.array(False))) == bad, (bad, poison)
    overflow = list(leaves)
    overflow[6] = overflow[6].at[0, 1, 2].set(3e19)  # finite, but its square is not
    result = check(overflow)
    assert int(checked_nonfinite_leaf(result, jnp.array(False))) == -2 - 6


def test_the_one_pass_check_of_nothing_is_finite():
    from precision.grad_norms import check_gradients

    result = check_gradients({"a": jnp.zeros((0, 4))})
    assert float(result.squares) == 0.0 and int(result.first_nonfinite) == -1
