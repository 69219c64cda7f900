"""The random bits stochastic rounding draws (precision.rounding_bits): uniform, independent,
deterministic in the key, and a few integer operations a value rather than threefry's hundred."""

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from precision.autocast.scaled.int8_quantize import stochastic_noise
from precision.quantized import quantize
from precision.rounding_bits import hashed_bits, mix32
from precision.stored import step_key, stochastic_round


def _chi2(values: np.ndarray, bins: int) -> float:
    counts = np.bincount(values.ravel(), minlength=bins)
    expected = values.size / bins
    return float(((counts - expected) ** 2 / expected).sum())


def test_the_bits_rounding_reads_are_uniform_and_independent_of_their_neighbours_and_of_the_step():
    bits = np.asarray(hashed_bits(step_key(jnp.uint32(7)), (1024, 1024)))
    noise = (bits >> 16).astype(np.int64)  # what stochastic_round adds
    # 256 bins of the noise's top and bottom bytes: chi-square with 255 degrees of freedom
    # (mean 255, sd 22.6); a biased or lattice-like generator lands in the thousands.
    assert _chi2(noise >> 8, 256) < 380 and _chi2(noise & 0xFF, 256) < 380
    u = noise / 65536.0
    for a, b in ((u[:, 1:], u[:, :-1]), (u[1:], u[:-1])):  # neighbours along each axis
        assert abs(np.corrcoef(a.ravel(), b.ravel())[0, 1]) < 0.01
    later = np.asarray(hashed_bits(step_key(jnp.uint32(8)), (1024, 1024))) >> 16
    assert abs(np.corrcoef(u.ravel(), later.ravel() / 65536.0)[0, 1]) < 0.01
    assert np.mean(later == noise) < 1e-3


def test_the_bits_are_a_pure_function_of_the_key_and_the_index():
    key = step_key(jnp.uint32(3), leaf=5)
    whole = np.asarray(hashed_bits(key, (6, 40, 9)))
    np.testing.assert_array_equal(whole, np.asarray(jax.jit(hashed_bits, static_argnums=1)(key, (6, 40, 9))))
    # an element's bits depend on its coordinates, not on the array's size
    assert not np.array_equal(whole[0], whole[1]) and not np.array_equal(whole[:, 0], whole[:, 1])
    assert np.unique(whole).size > 0.999 * whole.size


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**32 - 1))
def test_mix32_is_a_bijection_that_flips_about_half_the_bits_for_one_flipped_bit(x):
    xs = jnp.array([x] + [x ^ (1 << b) for b in range(32)], jnp.uint32)
    out = np.asarray(mix32(xs)).astype(np.uint64)
    assert np.unique(out).size == 33  # distinct inputs stay distinct
    flipped = [bin(int(out[0] ^ o)).count("1") for o in out[1:]]
    assert 10 < np.mean(flipped) < 22


@pytest.mark.parametrize("store", [lambda x, k: stochastic_round(x, k), lambda x, k: quantize(x, k).codes,
                                   lambda x, k: stochastic_noise(x, 1)], ids=["bf16", "8-bit blocks", "int8 gradient"])
def test_rounding_a_large_array_draws_no_threefry_stream_of_its_size(store):
    """threefry2x32 over every value made the bfloat16 update compute-bound on an H200 (76 ms
    of a 469 ms step at 8B): only the two seed words may come from ``jax.random`` (int8
    training's gradient noise too)."""
    x = jnp.ones((512, 512), jnp.float32)
    jaxpr = jax.make_jaxpr(store)(x, step_key(jnp.uint32(0)))

    def equations(jaxpr):
        for eqn in jaxpr.eqns:
            yield eqn
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                yield from equations(sub)

    drawn = [int(np.prod(v.aval.shape)) for e in equations(jaxpr.jaxpr)
             if e.primitive.name in ("random_bits", "threefry2x32") for v in e.outvars]
    assert drawn and max(drawn) <= 2, drawn
