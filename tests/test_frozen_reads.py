"""A frozen base stored in codes (precision.autocast.frozen_reads): each matmul reading it keeps
its codes for the backward pass, not a bfloat16 copy, with the same results and gradients."""

import jax
import jax.ad_checkpoint
import jax.numpy as jnp
import numpy as np
import flax.linen as nn
import pytest

import precision
from precision.channel_weights import dequantize_channels, is_channel_int8, quantize_channels
from precision.quantized_weights import quantizable


class _Adapted(nn.Module):
    """Frozen Dense and DenseGeneral layers, each with a trainable low-rank adapter beside it."""

    @nn.compact
    def __call__(self, x):
        def adapted(layer, x, features, name):
            down = nn.Dense(4, use_bias=False, name=f"{name}_a")(x)
            return layer(x).reshape(*x.shape[:-1], -1) + nn.Dense(features, use_bias=False, name=f"{name}_b")(down)

        h = nn.gelu(adapted(nn.Dense(256, name="up"), x, 256, "up"))
        h = adapted(nn.DenseGeneral((2, 64), name="split"), h, 128, "split")
        return nn.Dense(96, name="head")(nn.LayerNorm()(h))


def _setup(code):
    model, x = _Adapted(), jax.random.normal(jax.random.key(1), (8, 128))
    params = model.init(jax.random.key(0), x)["params"]
    base = {k: v for k, v in params.items() if not k.endswith(("_a", "_b"))}
    adapters = {k: v for k, v in params.items() if k.endswith(("_a", "_b"))}
    stored = jax.tree_util.tree_map(lambda a: precision.quantize_weight(a, code) if quantizable(a) else a, base)
    assert sum(map(precision.quantized_weights.is_quantized,
                   jax.tree_util.tree_leaves(stored, is_leaf=precision.quantized_weights.is_quantized))) == 3
    return precision.with_policy(model, "mixed_bf16"), stored, adapters, x


def _loss(wrapped, base):
    return lambda adapters, x: jnp.sum(wrapped.apply({"params": {**base, **adapters}}, x).astype(jnp.float32) ** 2)


@pytest.mark.parametrize("code", ["int8", "nf4"])
def test_matmuls_reading_codes_give_the_same_values_and_gradients_as_the_dequantized_weights(code):
    wrapped, stored, adapters, x = _setup(code)
    floats = precision.dequantized(stored)  # the weights read as floats outright: JAX's own backward pass
    got = jax.jit(jax.value_and_grad(_loss(wrapped, stored), argnums=(0, 1)))(adapters, x)
    want = jax.jit(jax.value_and_grad(_loss(wrapped, floats), argnums=(0, 1)))(adapters, x)
    chex_equal = lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b))  # noqa: E731
    jax.tree_util.tree_map(chex_equal, got, want)
    assert float(jnp.abs(got[1][1]).sum()) > 0 and float(jnp.abs(got[1][0]["up_a"]["kernel"]).sum()) > 0


def _saved(fn, *args, capsys):
    """The residuals JAX keeps for ``fn``'s backward pass, as ``bf16[128,256]``."""
    jax.ad_checkpoint.print_saved_residuals(fn, *args)
    return [line.split()[0] for line in capsys.readouterr().out.splitlines()]


def test_the_backward_pass_keeps_a_weights_codes_not_its_bfloat16_copy(capsys):
    wrapped, stored, adapters, x = _setup("nf4")
    weights = ("bf16[128,256]", "bf16[256,2,64]", "bf16[128,96]")
    saved = _saved(_loss(wrapped, stored), adapters, x, capsys=capsys)
    assert not set(weights) & set(saved) and "u8[512,32]" in saved, saved  # up's codes: 128 x 256 / 64 blocks
    floats = _saved(_loss(wrapped, precision.dequantized(stored)), adapters, x, capsys=capsys)
    assert set(weights) <= set(floats), floats  # what JAX's own backward pass keeps


class _Channels(nn.Module):
    """Weights read by matmuls three ways: a Dense kernel (in, out), a DenseGeneral one
    (in, heads, size), a weight stored (out, in) and read transposed."""

    @nn.compact
    def __call__(self, x):
        stored = self.param("stored", nn.initializers.normal(0.1), (48, x.shape[-1]))
        return (nn.Dense(64, use_bias=False, name="dense")(x),
                nn.DenseGeneral((2, 32), use_bias=False, name="general")(x), x @ stored.T)


def test_int8_channel_weights_are_multiplied_in_codes_and_scaled_after():
    # (x . codes) * scales: exact algebra for a scale per output channel; the codes (integers to
    # 127) are exact in bfloat16, the product accumulated in float32, scaled there, rounded once.
    model, x = _Channels(), jax.random.normal(jax.random.key(1), (4, 128))
    params = model.init(jax.random.key(0), x)["params"]
    axes = {"dense": {"kernel": (0,)}, "general": {"kernel": (0,)}, "stored": (1,)}
    quantized = jax.tree_util.tree_map(lambda w, a: quantize_channels(w, a), params, axes,
                                       is_leaf=lambda a: isinstance(a, tuple))
    wrapped = precision.with_policy(model, "mixed_bf16")
    got = jax.jit(lambda q, x: wrapped.apply({"params": q}, x))(quantized, x)
    half = x.astype(jnp.bfloat16)

    def scaled(codes, scales, subscripts):
        product = jnp.einsum(subscripts, half, codes.astype(jnp.bfloat16), preferred_element_type=jnp.float32)
        return (product * jnp.squeeze(scales)).astype(jnp.bfloat16)

    want = (scaled(quantized["dense"]["kernel"].codes, quantized["dense"]["kernel"].scales, "bi,io->bo"),
            scaled(quantized["general"]["kernel"].codes, quantized["general"]["kernel"].scales, "bi,ihd->bhd"),
            scaled(quantized["stored"].codes, quantized["stored"].scales, "bi,oi->bo"))
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32), rtol=1e-2, atol=1e-2)
    # as near the float32 product of the weights the codes stand for as the weights rounded to bfloat16 first
    floats = precision.dequantized(quantized)  # in bfloat16
    exact = model.apply({"params": jax.tree_util.tree_map(lambda q: dequantize_channels(q, jnp.float32), quantized,
                                                          is_leaf=is_channel_int8)}, x)
    rounded = wrapped.apply({"params": floats}, x)
    for g, r, e in zip(got, rounded, exact):
        assert np.abs(np.asarray(g, np.float32) - e).mean() <= np.abs(np.asarray(r, np.float32) - e).mean()
    # differentiable as the dequantized weights are
    grad = lambda p: jax.grad(lambda x: sum(jnp.sum(o.astype(jnp.float32)) for o in wrapped.apply({"params": p}, x)))(x)  # noqa: E731,E501
    np.testing.assert_allclose(grad(quantized), grad(floats), rtol=0.05, atol=0.05)
