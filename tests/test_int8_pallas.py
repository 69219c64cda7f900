"""The int8 Pallas TPU kernels (quantization in VMEM), run on a CPU by Pallas's interpreter:
the forward product and the input's gradient bit for bit the recipe's, the weight's gradient
(1 x 256 token tiles) close to it, and where the kernels are not used (stochastic rounding's
backward, shapes their blocks do not take)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from precision.autocast.scaled import int8_pallas, int8_tpu
from precision.autocast.scaled.int8_matmul import Backward, int8_dot, int8_product
from precision.autocast.scaled.int8_quantize import quantized_along

DIMS = (((1,), (0,)), ((), ()))


def _operands(m, k, n, seed=0):
    kx, kw, kg = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(kx, (m, k), jnp.float32).astype(jnp.bfloat16)
    w = jax.random.normal(kw, (k, n), jnp.float32) * 0.05
    g = jax.random.normal(kg, (m, n), jnp.float32).astype(jnp.bfloat16)
    return x, w, g


@pytest.fixture
def kernels_on_cpu(monkeypatch):
    """The TPU branch taken on this CPU, its kernels interpreted."""
    monkeypatch.setattr(int8_tpu, "choose", lambda kernel, fallback, *args: kernel(*args))
    monkeypatch.setattr(int8_tpu, "rows_matmul", functools.partial(int8_pallas.rows_matmul, interpret=True))
    monkeypatch.setattr(int8_tpu, "tiles_matmul", functools.partial(int8_pallas.tiles_matmul, interpret=True))


@pytest.mark.parametrize("n", [384, 640])  # 640: a last column block of 128 in a block of 512
def test_the_row_kernel_is_the_recipes_product_bit_for_bit(n):
    x, w, _ = _operands(256, 256, n)
    q_w, s_w = quantized_along(w, (0,))
    got = int8_pallas.rows_matmul(x, q_w, s_w, jnp.bfloat16, interpret=True)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(int8_product(jnp.bfloat16)(x, w, DIMS)))


def test_the_tiled_weight_gradient_is_close_to_the_recipes_and_to_the_exact_one():
    x, _, g = _operands(1024, 256, 384)
    got = int8_pallas.tiles_matmul(x, g, jnp.float32, interpret=True)  # 4 tiles of 256 tokens
    exact = jnp.dot(x.astype(jnp.float32).T, g.astype(jnp.float32))
    recipe = int8_product(jnp.float32)(x, g, (((0,), (0,)), ((), ())))
    err = lambda a: float(jnp.linalg.norm(a - exact) / jnp.linalg.norm(exact))  # noqa: E731
    assert err(got) < 0.015 and err(got) <= err(recipe) * 1.05  # tiles' scales are tighter than a whole column's
    assert not np.array_equal(np.asarray(got), np.asarray(recipe))


def test_a_non_finite_value_makes_its_row_nan_and_an_all_zero_row_zero():
    x, w, _ = _operands(128, 128, 256)
    x = x.at[3, 5].set(jnp.inf).at[7].set(0)
    q_w, s_w = quantized_along(w, (0,))
    got = np.asarray(int8_pallas.rows_matmul(x, q_w, s_w, jnp.float32, interpret=True))
    assert np.isnan(got[3]).all() and (got[7] == 0).all() and np.isfinite(np.delete(got, 3, 0)).all()


def _value_and_grads(backward, x, w, g):
    y, pull = jax.vjp(lambda a, b: int8_dot(a, b, DIMS, jnp.bfloat16, backward), x, w)
    return (y, *pull(g))


def test_int8_dot_through_the_kernels_values_and_gradients(kernels_on_cpu):
    x, w, g = _operands(512, 256, 384)
    y, dx, dw = _value_and_grads(Backward(fallback=np.dtype(jnp.bfloat16)), x, w, g)
    int8_tpu.choose, saved = int8_tpu._on_one_tpu, int8_tpu.choose  # the recipe, as a CPU runs it
    try:
        y0, dx0, dw0 = _value_and_grads(Backward(fallback=np.dtype(jnp.bfloat16)), x, w, g)
    finally:
        int8_tpu.choose = saved
    np.testing.assert_array_equal(np.asarray(y), np.asarray(y0))
    np.testing.assert_array_equal(np.asarray(dx), np.asarray(dx0))
    assert dw.dtype == dw0.dtype == w.dtype
    exact = jnp.dot(x.astype(jnp.float32).T, g.astype(jnp.float32))
    err = lambda a: float(jnp.linalg.norm(a - exact) / jnp.linalg.norm(exact))  # noqa: E731
    assert err(dw) < 0.015 and err(dw) <= 1.05 * err(dw0)  # as close to x^T g as the recipe's


def test_stochastic_rounding_keeps_the_recipes_backward_and_odd_shapes_keep_the_recipe(kernels_on_cpu):
    x, w, g = _operands(512, 256, 384)
    stochastic = Backward(stochastic=True, fallback=np.dtype(jnp.bfloat16), salt=3)
    with_kernels = _value_and_grads(stochastic, x, w, g)
    jaxpr = str(jax.make_jaxpr(lambda *a: _value_and_grads(stochastic, *a))(x, w, g))
    assert "int8_rows_matmul" in jaxpr and "int8_tiles_matmul" not in jaxpr  # the forward's kernel only
    assert int8_pallas.rows_blocks(200, 256, 384) is None and int8_pallas.tiles_blocks(512, 100, 384) is None
    odd = jax.make_jaxpr(lambda a, b: int8_dot(a, b, DIMS, jnp.bfloat16))(x[:200], w)
    assert "pallas" not in str(odd)
    assert all(bool(jnp.isfinite(v).all()) for v in with_kernels)
