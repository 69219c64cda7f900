"""A frozen base's codes laid out for decoding (precision.block_codes): the same weight bit for
bit, and a decode step's product that reads the codes, not a dequantized copy."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import precision
from helpers import all_eqns
from precision.block_codes import FEW_ROWS, block_codes, block_product, dequantize_blocks
from precision.quantized_weights import dequantize_weight

_quantize = jax.jit(precision.quantize_weight, static_argnums=1)


@settings(max_examples=10, deadline=None)  # each example compiles its shapes afresh
@given(rows=st.integers(1, 96), blocks=st.integers(1, 3), code=st.sampled_from(["nf4", "int8"]),
       contracted=st.sampled_from([0, 1]), seed=st.integers(0, 1000))
def test_laid_out_codes_are_the_stored_weight_bit_for_bit_and_multiply_as_it_does(rows, blocks, code, contracted,
                                                                                  seed):
    w = jax.random.normal(jax.random.key(seed), (rows, 64 * blocks))
    q = _quantize(w, code)
    laid = block_codes(q, contracted)
    assert laid.shape == q.shape and laid.nbytes == q.codes.size * q.codes.dtype.itemsize + 4 * q.scales.size
    np.testing.assert_array_equal(np.asarray(dequantize_blocks(laid)), np.asarray(dequantize_weight(q)))
    weight = np.asarray(dequantize_weight(q), np.float64)
    x = np.asarray(jax.random.normal(jax.random.key(seed + 1), (2, weight.shape[contracted])))
    y = block_product(jnp.asarray(x), laid.codes, laid.scales, code, contracted, jnp.float32)
    np.testing.assert_allclose(np.asarray(y), x @ (weight if contracted == 0 else weight.T), rtol=1e-4, atol=1e-4)


def test_weights_whose_blocks_are_not_runs_of_one_row_stay_as_stored():
    q = _quantize(jnp.ones((64, 96)), "nf4")  # 96 is no multiple of 64: blocks straddle rows
    assert block_codes(q, 0) is None and block_codes(q, 1) is None
    assert block_codes(_quantize(jnp.ones((4, 8, 64)), "nf4"), 0) is None  # 3-D


class _Dense(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(128, name="proj")(x)


@pytest.mark.parametrize("rows", [1, FEW_ROWS, FEW_ROWS + 1])
def test_a_decode_step_multiplies_the_codes_and_a_prompt_the_weight_dequantized(rows):
    model = _Dense()
    x = jax.random.normal(jax.random.key(0), (rows, 256))
    params = model.init(jax.random.key(1), x)["params"]
    q = _quantize(params["proj"]["kernel"], "nf4").replace(dtype=np.dtype(jnp.bfloat16))
    laid = {"proj": {**params["proj"], "kernel": block_codes(q, 0)}}
    bound = precision.with_policy(model, "params=bf16,compute=bf16,output=f32")
    y = bound.apply({"params": laid}, x)
    reference = x @ np.asarray(dequantize_weight(q.replace(dtype=np.dtype(np.float32)))) + params["proj"]["bias"]
    np.testing.assert_allclose(np.asarray(y), np.asarray(reference), rtol=2e-2, atol=5e-2)
    jaxpr = jax.make_jaxpr(lambda p, x: bound.apply({"params": p}, x))(laid, x).jaxpr
    chosen = [e for e in all_eqns(jaxpr) if "branches_platforms" in e.params]
    dots = [[e.primitive.name for e in all_eqns(branch.jaxpr)].count("dot_general") for branch in
            (chosen[0].params["branches"] if chosen else ())]
    # few rows: on a GPU one sum over x * S * L (no matmul of the weight), elsewhere the weight dequantized
    # and multiplied; more rows: the latter everywhere
    if rows <= FEW_ROWS:
        assert chosen[0].params["branches_platforms"] == (("cuda", "rocm"), None) and dots == [0, 1]
    else:
        assert not chosen


class _Embedded(nn.Module):
    @nn.compact
    def __call__(self, ids):
        return nn.Embed(300, 128, name="tokens")(ids).sum(-1)


def test_rows_looked_up_come_from_their_codes_alone_with_the_same_values():
    model = _Embedded()
    ids = jnp.asarray([[0, 5, 299], [7, 7, 123]])
    table = model.init(jax.random.key(0), ids)["params"]["tokens"]["embedding"]
    q = _quantize(table, "nf4").replace(dtype=np.dtype(jnp.bfloat16))
    bound = precision.with_policy(model, "params=bf16,compute=bf16,output=f32")
    apply = lambda p, ids: bound.apply({"params": {"tokens": {"embedding": p}}}, ids)  # noqa: E731
    np.testing.assert_array_equal(np.asarray(apply(block_codes(q, 1), ids)), np.asarray(apply(q, ids)))
    # the compiled program never makes the whole table (as stored, the gather read it dequantized)
    for weight, tables in ((q, 1), (block_codes(q, 1), 0)):
        assert jax.jit(apply).lower(weight, ids).compile().as_text().count("[300,128]") == tables
