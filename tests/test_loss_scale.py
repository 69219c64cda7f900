"""Loss scales: jmp compatibility, growth/backoff/min/max/hysteresis, jit and checkpoints."""

import dataclasses

import chex
import jax
import jax.numpy as jnp
import jmp
import numpy as np
import orbax.checkpoint as ocp
import pytest

import precision
from precision import DynamicLossScale, NoOpLossScale, StaticLossScale

T, F = jnp.array(True), jnp.array(False)


def run(loss_scale, finite_seq, adjust=None):
    """Feeds a finiteness sequence through adjust; returns the scales seen after each step."""
    adjust = adjust or (lambda ls, f: ls.adjust(f))
    scales = []
    for finite in finite_seq:
        loss_scale = adjust(loss_scale, jnp.array(bool(finite)))
        scales.append(float(loss_scale.loss_scale))
    return loss_scale, scales


class DynamicTest(chex.TestCase):

    @chex.variants(with_jit=True, without_jit=True)
    def test_grows_every_period_and_backs_off(self):
        adjust = self.variant(lambda ls, f: ls.adjust(f))
        ls, scales = run(DynamicLossScale(jnp.float32(8.0), period=2), [1, 1, 1, 1, 0, 1, 0, 0], adjust)
        assert scales == [8, 16, 16, 32, 16, 16, 8, 4]
        assert int(ls.skipped_steps) == 3 and int(ls.nonfinite_streak) == 2

    @chex.variants(with_jit=True, without_jit=True)
    def test_separate_backoff_factor(self):
        adjust = self.variant(lambda ls, f: ls.adjust(f))
        _, scales = run(DynamicLossScale(64.0, period=1, factor=4, backoff_factor=0.25), [0, 1, 0], adjust)
        assert scales == [16, 64, 16]

    @chex.variants(with_jit=True, without_jit=True)
    def test_clamped_at_min_and_max(self):
        adjust = self.variant(lambda ls, f: ls.adjust(f))
        ls, scales = run(DynamicLossScale(4.0, period=1, min_loss_scale=2.0, max_loss_scale=16.0),
                         [0, 0, 0, 1, 1, 1, 1, 1], adjust)
        assert scales == [2, 2, 2, 4, 8, 16, 16, 16]
        assert float(ls.min_loss_scale) == 2 and float(ls.max_loss_scale) == 16

    @chex.variants(with_jit=True, without_jit=True)
    def test_hysteresis_tolerates_consecutive_overflows(self):
        adjust = self.variant(lambda ls, f: ls.adjust(f))
        # hysteresis=2: back off on every second consecutive overflow; a finite step resets it.
        ls, scales = run(DynamicLossScale(64.0, period=100, hysteresis=2), [0, 1, 0, 0, 0, 0], adjust)
        assert scales == [64, 64, 64, 32, 32, 16]
        assert int(ls.skipped_steps) == 5 and int(ls.nonfinite_streak) == 4

    @chex.variants(with_jit=True, without_jit=True)
    def test_never_grows_to_inf(self):
        adjust = self.variant(lambda ls, f: ls.adjust(f))
        big = float(np.finfo(np.float32).max) / 2
        ls, scales = run(DynamicLossScale(big, period=1, max_loss_scale=np.finfo(np.float32).max), [1] * 3, adjust)
        assert all(np.isfinite(scales))
        ls, scales = run(DynamicLossScale(2.0 ** 23, period=1), [1] * 5, adjust)
        assert scales[-1] == 2.0 ** 24  # the default max

    def test_state_is_float32_even_from_a_float16_scale(self):
        # jmp#47: an f16 loss scale crashes jmp's adjust; ours converts to float32.
        ls = DynamicLossScale(jnp.asarray(2.0 ** 15, jnp.float16))
        assert ls.loss_scale.dtype == jnp.float32
        out = jax.jit(lambda ls: ls.adjust(F))(ls)
        assert out.loss_scale.dtype == jnp.float32 and float(out.loss_scale) == 2.0 ** 14
        assert StaticLossScale(jnp.float16(8)).loss_scale.dtype == jnp.float32

    def test_every_field_survives_jit_and_tree_map(self):
        ls = DynamicLossScale(8.0, counter=3, period=7, factor=3, min_loss_scale=0.5, backoff_factor=0.25,
                              max_loss_scale=1024.0, hysteresis=3, skipped_steps=5, nonfinite_streak=1)
        for out in (jax.jit(lambda x: x)(ls), jax.tree_util.tree_map(lambda x: x, ls)):
            for field in dataclasses.fields(ls):
                np.testing.assert_array_equal(getattr(out, field.name), getattr(ls, field.name))
        # jmp drops min_loss_scale through jit; we must not.
        assert float(jax.jit(lambda x: x)(ls).min_loss_scale) == 0.5

class StaticAndNoOpTest(chex.TestCase):

    @chex.variants(with_jit=True, without_jit=True)
    def test_static_scales_and_counts(self):
        ls = StaticLossScale(128.0)
        scaled = self.variant(ls.scale)(jnp.float32(2.0))
        assert float(scaled) == 256.0
        assert float(self.variant(ls.unscale)(scaled)) == 2.0
        out = self.variant(lambda ls, f: ls.adjust(f))(ls, F)
        assert float(out.loss_scale) == 128.0 and int(out.skipped_steps) == 1

    @chex.variants(with_jit=True, without_jit=True)
    def test_noop(self):
        ls = NoOpLossScale()
        x = {"a": jnp.ones(2, jnp.float16)}
        assert self.variant(ls.scale)(x)["a"].dtype == jnp.float16
        out = self.variant(lambda ls, f: ls.adjust(f))(ls, F)
        out = self.variant(lambda ls, f: ls.adjust(f))(out, T)
        assert float(out.loss_scale) == 1.0 and int(out.skipped_steps) == 1 and int(out.nonfinite_streak) == 0

    def test_adjust_rejects_non_scalar_bool(self):
        with pytest.raises(TypeError, match="scalar bool"):
            DynamicLossScale(2.0).adjust(jnp.array([True, False]))
        with pytest.raises(AssertionError, match="expected boolean scalar"):  # what jmp raises
            DynamicLossScale(2.0).adjust(jnp.array([True, False]))


def test_all_finite_and_select_tree():
    assert bool(precision.all_finite({"a": jnp.ones(3), "b": jnp.zeros(2, jnp.float16)}))
    assert not bool(precision.all_finite({"a": jnp.ones(3), "b": jnp.array([jnp.nan])}))
    assert not bool(precision.all_finite([jnp.array([jnp.inf], jnp.float16)]))
    assert bool(precision.all_finite({}))
    a, b = {"x": jnp.array([-0.0, 1.0])}, {"x": jnp.array([5.0, 6.0])}
    out = jax.jit(precision.select_tree)(T, a, b)
    assert np.signbit(out["x"][0])  # bit-exact: -0.0 stays -0.0
    chex.assert_trees_all_equal(precision.select_tree(F, a, b), b)
    with pytest.raises(TypeError, match="scalar bool"):
        precision.select_tree(jnp.array(1.0), a, b)
    # jmp asserts: code written against jmp catches AssertionError.
    with pytest.raises(AssertionError, match="expected boolean scalar"):
        precision.select_tree(jnp.ones([1]), a, b)
    assert issubclass(precision.ScalarBoolError, TypeError) and issubclass(precision.ScalarBoolError, AssertionError)


def test_get_loss_scale():
    assert isinstance(precision.get_loss_scale("auto", "mixed_f16"), DynamicLossScale)
    assert isinstance(precision.get_loss_scale("auto", "O2"), DynamicLossScale)
    assert isinstance(precision.get_loss_scale("auto", "mixed_bf16"), NoOpLossScale)
    assert isinstance(precision.get_loss_scale("auto", "fp32"), NoOpLossScale)
    assert float(precision.get_loss_scale("static", initial_scale=64).loss_scale) == 64
    dyn = precision.get_loss_scale("dynamic", initial_scale=2.0 ** 10, period=10, hysteresis=2)
    assert dyn.period == 10 and dyn.hysteresis == 2 and float(dyn.loss_scale) == 1024
    with pytest.raises(ValueError, match="valid: auto, none, static, dynamic"):
        precision.get_loss_scale("dynamc")
    with pytest.raises(ValueError, match="needs the policy"):
        precision.get_loss_scale("auto")
    with pytest.raises(ValueError, match="only apply to a dynamic"):
        precision.get_loss_scale("none", period=3)


def test_code_written_against_jmp_runs_with_precision():
    """jmp's own documented loop, run with both libraries, gives the same scales."""

    def jmp_style_loop(lib, finite_seq):
        loss_scale = lib.DynamicLossScale(jnp.asarray(2.0 ** 15), period=2)
        seen = []
        for finite in finite_seq:
            grads = {"w": jnp.array([1.0 if finite else jnp.inf])}
            loss = loss_scale.scale(jnp.float32(1.0))
            grads = loss_scale.unscale(grads)
            grads_finite = lib.all_finite(grads)
            loss_scale = loss_scale.adjust(grads_finite)
            grads = lib.select_tree(grads_finite, grads, jax.tree_util.tree_map(jnp.zeros_like, grads))
            seen.append((float(loss), float(loss_scale.loss_scale)))
        policy = lib.get_policy("p=f32,c=f16")
        return seen, policy.cast_to_compute(jnp.ones(1)).dtype, str(lib.NoOpLossScale().scale(1.0))

    seq = [1, 1, 0, 1, 1, 1, 0, 0]
    assert jmp_style_loop(precision, seq) == jmp_style_loop(jmp, seq)
    assert float(precision.StaticLossScale(4.0).loss_scale) == float(jmp.StaticLossScale(4.0).loss_scale)


def test_checkpoint_round_trip(tmp_path):
    ls = DynamicLossScale(8.0, counter=3, period=7, min_loss_scale=0.5, max_loss_scale=1024.0,
                          hysteresis=2, skipped_steps=5, nonfinite_streak=1).adjust(F)
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(tmp_path / "ls", ls)
        ckptr.wait_until_finished()
        restored = ckptr.restore(tmp_path / "ls", jax.tree_util.tree_map(jnp.zeros_like, ls))
    assert isinstance(restored, DynamicLossScale)
    for field in dataclasses.fields(ls):
        np.testing.assert_array_equal(getattr(restored, field.name), getattr(ls, field.name))
    assert restored.hysteresis_left.dtype == jnp.int32 and restored.loss_scale.dtype == jnp.float32

class JmpConstructionsTest(chex.TestCase):
    """Whatever jmp accepts, we accept, with jmp's meaning."""

    @chex.variants(with_jit=True, without_jit=True)
    def test_factor_divides_on_a_non_finite_step_as_in_jmp(self):
        adjust = self.variant(lambda ls, f: ls.adjust(f))
        for factor in (2, 3, 4.5):
            ours = adjust(DynamicLossScale(10.0, 0, 20, factor=factor), F)
            theirs = adjust(jmp.DynamicLossScale(jnp.float32(10), jnp.int32(0), 20, factor), F)
            assert float(ours.loss_scale) == float(theirs.loss_scale)  # as jmp: 10 / 3, not 10 * 0.5
            assert ours.backoff_factor == 1 / factor
        # Positional, as jmp's signature: (loss_scale, counter, period, factor, min_loss_scale).
        ls = adjust(DynamicLossScale(jnp.float32(27), jnp.int32(0), 5, 3, jnp.float32(2)), F)
        assert float(ls.loss_scale) == 9.0
        # An explicit backoff_factor still wins.
        assert float(adjust(DynamicLossScale(10.0, factor=3, backoff_factor=0.5), F).loss_scale) == 5.0

    @chex.variants(with_jit=True, without_jit=True)
    def test_an_initial_scale_above_2_24_raises_the_default_cap(self):
        adjust = self.variant(lambda ls, f: ls.adjust(f))
        ls = DynamicLossScale(jnp.float32(3e38), period=1)
        assert float(ls.max_loss_scale) == float(jnp.float32(3e38))
        for _ in range(3):
            ls = adjust(ls, T)
            assert np.isfinite(float(ls.loss_scale))  # never inf
        assert float(DynamicLossScale(2.0 ** 30).max_loss_scale) == 2.0 ** 30
        assert float(DynamicLossScale(2.0 ** 10).max_loss_scale) == 2.0 ** 24

    def test_jmp_valid_arguments_are_accepted(self):
        ls = DynamicLossScale(jnp.float32(10), jnp.int32(0), 5.0, 2.0, jnp.asarray(0.0))
        assert ls.period == 5 and isinstance(ls.period, int) and float(ls.min_loss_scale) == 0.0
        assert int(jax.jit(lambda ls: ls.adjust(T))(ls).counter) == 1
        assert float(StaticLossScale(0.0).loss_scale) == 0.0
        assert float(StaticLossScale(0).loss_scale) == 0.0
        below_min = DynamicLossScale(jnp.float32(0.5))  # jmp: min_loss_scale 1 applies from the next back-off
        assert float(below_min.adjust(F).loss_scale) == float(jmp.DynamicLossScale(jnp.float32(0.5)).adjust(F).loss_scale)
        assert DynamicLossScale(2.0, factor=1).adjust(F).loss_scale == 2.0  # factor 1: a scale that never moves
        numpy_meta = DynamicLossScale(8.0, period=np.int32(2), factor=jnp.float32(4))  # static fields must hash
        assert float(jax.jit(lambda ls: ls.adjust(F))(numpy_meta).loss_scale) == 2.0


@pytest.mark.parametrize("kwargs,match", [
    (dict(loss_scale=-1.0), "loss_scale must be finite and >= 0"),
    (dict(loss_scale=float("inf")), "loss_scale must be finite"),
    (dict(loss_scale=2.0, min_loss_scale=float("nan")), "min_loss_scale must be finite"),
    (dict(loss_scale=2.0, period=0), "period"),
    (dict(loss_scale=2.0, period=2.5), "period must be a whole number"),
    (dict(loss_scale=2.0, period="5"), "period must be a whole number"),
    (dict(loss_scale=2.0, factor=0.5), "factor"),
    (dict(loss_scale=2.0, backoff_factor=1.5), "backoff_factor"),
    (dict(loss_scale=2.0, hysteresis=0), "hysteresis"),
    (dict(loss_scale=8.0, max_loss_scale=4.0), "must not exceed max_loss_scale"),
    (dict(loss_scale=2.0, min_loss_scale=4.0, max_loss_scale=3.0), "must not exceed"),
])
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DynamicLossScale(**kwargs)
