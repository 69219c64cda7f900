"""Weights stored in 8 or 4 bits (precision.quantized_weights): a frozen base read as floats."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import precision
from helpers import all_eqns
from precision.quantized_weights import BLOCK, NF4_LEVELS, dequantize_weight, logical_size, quantizable


def test_normal_float_levels_are_qloras_sixteen_quantiles():
    assert NF4_LEVELS.shape == (16,) and NF4_LEVELS[0] == -1 and NF4_LEVELS[-1] == 1 and 0.0 in NF4_LEVELS
    assert np.all(np.diff(NF4_LEVELS) > 0)
    assert (NF4_LEVELS < 0).sum() == 7 and (NF4_LEVELS > 0).sum() == 8  # one more positive level
    np.testing.assert_allclose(NF4_LEVELS[8:11], [0.0795803, 0.1609302, 0.2461123], atol=1e-6)  # QLoRA's table


_quantize = jax.jit(precision.quantize_weight, static_argnums=1)
_dequantize = jax.jit(dequantize_weight)


@settings(max_examples=25, deadline=None)
@given(rows=st.integers(1, 70), cols=st.integers(1, 70), scale=st.floats(1e-6, 1e3), seed=st.integers(0, 1000))
def test_every_value_comes_back_within_half_a_code_step_of_its_block(rows, cols, scale, seed):
    x = jax.random.normal(jax.random.key(seed), (rows, cols)) * scale
    for code, step in (("int8", 1 / 127), ("nf4", float(np.diff(NF4_LEVELS).max()))):
        q = _quantize(x, code)  # jitted: one compile per shape, not one per op (eager: minutes in all)
        y = _dequantize(q)
        assert y.shape == x.shape and y.dtype == x.dtype
        flat = np.pad(np.asarray(x).reshape(-1), (0, -x.size % BLOCK)).reshape(-1, BLOCK)
        block_max = np.repeat(np.abs(flat).max(axis=1), BLOCK)[:x.size].reshape(x.shape)
        assert np.all(np.abs(np.asarray(y) - np.asarray(x)) <= block_max * step / 2 * (1 + 1e-5) + 1e-30)


def test_storage_is_one_byte_or_half_a_byte_per_value_plus_a_scale_per_block():
    x = jnp.ones((256, 256))
    for code, per_value in (("int8", 1 + 4 / BLOCK), ("nf4", 0.5 + 4 / BLOCK)):
        q = precision.quantize_weight(x, code)
        stored = sum(a.size * a.dtype.itemsize for a in jax.tree_util.tree_leaves(q))
        assert stored / x.size == per_value and logical_size(q) == x.size


def test_dequantized_reads_only_the_quantized_leaves_and_inside_jit():
    w = jax.random.normal(jax.random.key(0), (64, 128))
    tree = {"dense": {"kernel": precision.quantize_weight(w, "nf4"), "bias": jnp.ones(128)}}
    out = jax.jit(precision.dequantized)(tree)
    assert out["dense"]["bias"] is not None and out["dense"]["kernel"].shape == (64, 128)
    np.testing.assert_allclose(out["dense"]["kernel"], w, atol=float(jnp.abs(w).max()) * 0.15)
    assert precision.dequantized({"a": jnp.ones(3)})["a"].shape == (3,)


def test_only_matrices_large_enough_are_quantizable_and_a_bad_code_is_refused():
    assert quantizable(jnp.ones((64, 64))) and not quantizable(jnp.ones(8192)) and not quantizable(jnp.ones((8, 8)))
    assert not quantizable(jnp.ones((64, 64), jnp.int32))
    with pytest.raises(ValueError, match=r"code 'int4'; valid: int8, nf4"):
        precision.quantize_weight(jnp.ones((64, 64)), "int4")


def test_nf4_is_read_elementwise_as_its_table_of_levels_says():
    """Each code's level, as a lookup in the 16 levels gives it, computed by elementwise ops
    only: no gather and no unpacked indices, which XLA would hold whole for each weight
    (issue 67: the nf4 base's step peaked above the int8 one's)."""
    x = jax.random.normal(jax.random.key(0), (96, 70))
    q = precision.quantize_weight(x, "nf4")
    codes = np.asarray(q.codes)
    index = np.stack([codes & 15, codes >> 4], -1).reshape(codes.shape[0], -1)
    expected = (NF4_LEVELS[index] * np.asarray(q.scales)[:, None]).reshape(-1)[:x.size].reshape(x.shape)
    np.testing.assert_array_equal(np.asarray(dequantize_weight(q)), expected)
    primitives = {e.primitive.name for e in all_eqns(jax.make_jaxpr(dequantize_weight)(q).jaxpr)}
    assert not primitives & {"gather", "concatenate"}, primitives
