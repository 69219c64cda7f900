"""The int8 Pallas TPU kernels (quantization in VMEM), run on a CPU by Pallas's interpreter:
the forward product and the input's gradient bit for bit the recipe's, the weight's gradient
(1 x 256 token tiles) and a head's input gradient (tiles of its vocabulary) close to it, and
where the kernels are not used (stochastic rounding's backward, shapes their blocks do not
take). That they are in a program compiled for a v5e: tests/test_int8_compile.py."""

import functools
import re
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import precision
from helpers import all_eqns, pallas_calls

from precision.autocast.scaled import int8_blocks, int8_pallas, int8_tpu
from precision.autocast.scaled.int8_matmul import Backward, int8_dot, int8_product
from precision.autocast.scaled.int8_quantize import quantized_along

DIMS = (((1,), (0,)), ((), ()))


def _operands(m, k, n, seed=0):
    kx, kw, kg = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(kx, (m, k), jnp.float32).astype(jnp.bfloat16)
    w = jax.random.normal(kw, (k, n), jnp.float32) * 0.05
    g = jax.random.normal(kg, (m, n), jnp.float32).astype(jnp.bfloat16)
    return x, w, g


@pytest.mark.parametrize("small", [False, True])  # the weight one block; or blocks of 512 columns, one partial,
def test_the_row_kernel_is_the_recipes_product_bit_for_bit(small, monkeypatch):  # rows quantized 128 columns at a time
    if small:
        monkeypatch.setattr(int8_blocks, "_BLOCK_BYTES", 2**16)
        monkeypatch.setattr(int8_pallas, "_CHUNK", 128)
    x, w, _ = _operands(256, 256, 640)
    assert int8_pallas.rows_blocks(256, 256, 640) == ((256, 512) if small else (256, 640))
    q_w, s_w = quantized_along(w, (0,))
    got = int8_pallas.rows_matmul(x, q_w, s_w, jnp.bfloat16, interpret=True)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(int8_product(jnp.bfloat16)(x, w, DIMS)))
    # the weight given as its rows (N, K), as the input's gradient reads it: the same values
    rows = int8_pallas.rows_matmul(x, q_w.T, s_w, jnp.bfloat16, interpret=True, weight_rows=True)
    np.testing.assert_array_equal(np.asarray(rows), np.asarray(got))


def test_the_tiled_weight_gradient_is_close_to_the_recipes_and_to_the_exact_one():
    x, _, g = _operands(1024, 256, 384)
    got = int8_pallas.tiles_matmul(x, g, jnp.float32, interpret=True)  # 4 tiles of 256 tokens
    exact = jnp.dot(x.astype(jnp.float32).T, g.astype(jnp.float32))
    recipe = int8_product(jnp.float32)(x, g, (((0,), (0,)), ((), ())))
    err = lambda a: float(jnp.linalg.norm(a - exact) / jnp.linalg.norm(exact))  # noqa: E731
    assert err(got) < 0.015 and err(got) <= err(recipe) * 1.05  # tiles' scales are tighter than a whole column's
    assert not np.array_equal(np.asarray(got), np.asarray(recipe))


def test_a_head_input_gradient_contracts_its_vocabulary_in_row_tiles_close_to_the_recipe():
    g, w = _operands(256, 2304, 256)[0], _operands(256, 256, 2304, seed=1)[1]  # w (k, vocab)
    assert int8_pallas.row_tiles_blocks(256, 2304, 256)[1] == 1152  # two tiles of the vocabulary
    q_w, s_w = quantized_along(w, (1,))
    got = int8_pallas.row_tiles_matmul(g, q_w, s_w.T, jnp.float32, interpret=True)
    exact = jnp.dot(g.astype(jnp.float32), w.T)
    recipe = int8_product(jnp.float32)(g, w, (((1,), (1,)), ((), ())))
    err = lambda a: float(jnp.linalg.norm(a - exact) / jnp.linalg.norm(exact))  # noqa: E731
    assert err(got) < 0.015 and err(got) <= 1.05 * err(recipe)


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
    # the input's gradient reads the int8 weight's rows as stored: transposing them, XLA transposed the
    # float32 master weight (the codes' producer) in a copy of its own each step
    jaxpr = str(jax.make_jaxpr(lambda *a: _value_and_grads(Backward(fallback=np.dtype(jnp.bfloat16)), *a))(x, w, g))
    assert "int8_rows_matmul" in jaxpr and not re.search(r"i8\[384,256\] = transpose", jaxpr)


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


def test_under_vmap_the_tpu_branch_maps_the_recipe():
    x, w, g = _operands(512, 256, 384)
    mapped = jax.vmap(lambda a: int8_dot(a, w, DIMS, jnp.bfloat16), in_axes=1, out_axes=1)
    xs = jnp.stack([x, -x], axis=1)  # (512, 2, 256): the mapped axis in the middle
    np.testing.assert_array_equal(np.asarray(mapped(xs)[:, 0]), np.asarray(int8_dot(x, w, DIMS, jnp.bfloat16)))


def test_tpu_kernels_off_keeps_the_recipe_in_both_passes_and_the_config_key_reaches_it(kernels_on_cpu):
    from train.config import load_config

    x, w, g = _operands(512, 256, 384)
    off = Backward(fallback=np.dtype(jnp.bfloat16), kernels=False)
    jaxpr = str(jax.make_jaxpr(lambda *a: _value_and_grads(off, *a))(x, w, g))
    assert "pallas" not in jaxpr
    on = str(jax.make_jaxpr(lambda *a: _value_and_grads(Backward(fallback=np.dtype(jnp.bfloat16)), *a))(x, w, g))
    assert "int8_rows_matmul" in on and "int8_tiles_matmul" in on
    config = load_config("configs/default.yaml", ["precision.policy=mixed_int8", "precision.int8.tpu_kernels=false"])
    assert config.precision.int8.options().tpu_kernels is False
    with pytest.raises(precision.PolicyError, match="tpu_kernels"):
        precision.int8_options(tpu_kernels="no")


def test_the_kernels_take_a_product_that_is_a_matmul_once_its_operands_are_viewed_as_matrices():
    Matmul, sizes = int8_tpu.Matmul, int8_tpu.kernel_sizes
    x4, x3 = jnp.zeros((2, 8, 4, 16)), jnp.zeros((2, 8, 64))
    # a DenseGeneral over heads and head features (Flax attention's output projection): (16, 64) x (64, 32)
    assert sizes(x4, jnp.zeros((4, 16, 32)), (((2, 3), (0, 1)), ((), ()))) == Matmul(16, 64, 32)
    # x . wᵀ (einsum "btd,vd->btv", a head tied to its embedding), the weight read as its rows
    assert sizes(x3, jnp.zeros((100, 64)), (((2,), (1,)), ((), ()))) == Matmul(16, 64, 100, weight_rows=True)
    assert sizes(x4, jnp.zeros((32, 4, 16)), (((2, 3), (1, 2)), ((), ()))) == Matmul(16, 64, 32, weight_rows=True)
    # not a view: contracted axes out of order, or not the lhs's trailing ones; batch axes; a vector
    assert sizes(x4, jnp.zeros((16, 4, 32)), (((2, 3), (1, 0)), ((), ()))) is None
    assert sizes(x3, jnp.zeros((8, 32)), (((1,), (0,)), ((), ()))) is None
    assert sizes(x3, jnp.zeros((2, 64, 32)), (((2,), (1,)), ((0,), (0,)))) is None
    assert sizes(x3, jnp.zeros((64,)), (((2,), (0,)), ((), ()))) is None


@pytest.mark.parametrize("form", ["dense_general", "weight_rows", "weight_rows_general"])
def test_a_general_product_through_the_kernels_is_the_recipes(form, kernels_on_cpu):
    """Values and both gradients through the kernels, against the recipe as a CPU runs it: the forward
    product and the input's gradient bit for bit, the weight's gradient (tiles) as close to exact."""
    x, w, g = _operands(512, 256, 384)
    if form == "dense_general":  # (b, t, h, d) . (h, d, n)
        x, w, dims = x.reshape(2, 256, 4, 64), w.reshape(4, 64, 384), (((2, 3), (0, 1)), ((), ()))
        g = g.reshape(2, 256, 384)
    elif form == "weight_rows":  # (b, t, d) . (n, d)ᵀ
        x, w, dims = x.reshape(2, 256, 256), w.T, (((2,), (1,)), ((), ()))
        g = g.reshape(2, 256, 384)
    else:  # (b, t, d) . (n1, n2, d)ᵀ
        x, w, dims = x.reshape(2, 256, 256), w.T.reshape(3, 128, 256), (((2,), (2,)), ((), ()))
        g = g.reshape(2, 256, 3, 128)
    backward = Backward(fallback=np.dtype(jnp.bfloat16))

    def value_and_grads():
        y, pull = jax.vjp(lambda a, b: int8_dot(a, b, dims, jnp.bfloat16, backward), x, w)
        return (y, *pull(g))

    y, dx, dw = value_and_grads()
    jaxpr = str(jax.make_jaxpr(value_and_grads)())
    assert jaxpr.count("pallas_call[") == 3 and "int8_rows_matmul" in jaxpr and "int8_tiles_matmul" in jaxpr
    int8_tpu.choose, saved = int8_tpu._on_one_tpu, int8_tpu.choose  # the recipe, as a CPU runs it
    try:
        y0, dx0, dw0 = value_and_grads()
    finally:
        int8_tpu.choose = saved
    assert y.shape == y0.shape and dx.shape == x.shape and dw.shape == w.shape == dw0.shape
    np.testing.assert_array_equal(np.asarray(y), np.asarray(y0))
    np.testing.assert_array_equal(np.asarray(dx), np.asarray(dx0))
    exact = jax.vjp(lambda b: jax.lax.dot_general(x.astype(jnp.float32), b, dims), w)[1](g.astype(jnp.float32))[0]
    err = lambda a: float(jnp.linalg.norm(a - exact) / jnp.linalg.norm(exact))  # noqa: E731
    assert err(dw) < 0.015 and err(dw) <= 1.05 * err(dw0)


def test_a_weight_held_as_rows_too_wide_for_a_block_takes_the_row_tiles_for_its_input_gradient(monkeypatch):
    """``dy . w`` for ``w (n, k)`` where ``n`` (a vocabulary) is too wide for a row block: tiles along ``n``
    of ``w``'s int8 columns, close to the recipe."""
    monkeypatch.setattr(int8_tpu, "row_tiles_matmul", functools.partial(int8_pallas.row_tiles_matmul, interpret=True))
    monkeypatch.setattr(int8_tpu, "rows_blocks", lambda *a: None)  # as for a vocabulary past a block
    g, w = _operands(256, 2304, 256)[0], _operands(256, 2304, 256, seed=1)[1][:, :256]  # w (vocab, k)
    got, _ = int8_tpu._input_gradient(g, w, jnp.float32, weight_rows=True)
    exact = jnp.dot(g.astype(jnp.float32), w)
    recipe = int8_product(jnp.float32)(g, w, (((1,), (0,)), ((), ())))
    err = lambda a: float(jnp.linalg.norm(a - exact) / jnp.linalg.norm(exact))  # noqa: E731
    assert got.shape == (256, 256) and err(got) < 0.015 and err(got) <= 1.05 * err(recipe)


def test_a_bias_added_in_the_kernel_is_the_recipes_sum_and_its_gradient_the_gradients_sum(kernels_on_cpu):
    """A projection's bias added by the row kernel (before its one rounding) against the recipe's product
    and the model's add: float32 results the same sum; bfloat16 ones within a rounding; the bias's gradient
    the output gradient's sum over the rows it was broadcast over."""
    x, w, g = _operands(512, 256, 384)
    x3, g3 = x.reshape(2, 256, 256), g.reshape(2, 256, 384)
    b = jax.random.normal(jax.random.key(7), (1, 1, 384), jnp.float32)
    dims = (((2,), (0,)), ((), ()))
    backward = Backward(fallback=np.dtype(jnp.bfloat16))

    def value_and_grads(out_dtype):
        y, pull = jax.vjp(lambda a, c, d: int8_dot(a, c, dims, out_dtype, backward, bias=d), x3, w, b)
        return (y, *pull(g3.astype(out_dtype)))

    assert "int8_rows_matmul" in str(jax.make_jaxpr(lambda: value_and_grads(jnp.bfloat16))())
    y, dx, dw, db = value_and_grads(jnp.float32)
    y16 = value_and_grads(jnp.bfloat16)[0]
    recipe = int8_product(jnp.float32)(x3, w, dims)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(recipe + b))
    np.testing.assert_allclose(np.asarray(y16, np.float32), np.asarray(recipe + b), rtol=2**-8, atol=1e-6)
    np.testing.assert_allclose(np.asarray(db), np.asarray(g3, np.float32).sum((0, 1), keepdims=True), rtol=1e-5)
    int8_tpu.choose, saved = int8_tpu._on_one_tpu, int8_tpu.choose  # the recipe and the add, as a CPU runs them
    try:
        y0, dx0, _, db0 = value_and_grads(jnp.float32)
    finally:
        int8_tpu.choose = saved
    np.testing.assert_array_equal(np.asarray(y0), np.asarray(y))
    np.testing.assert_array_equal(np.asarray(dx0), np.asarray(dx))
    np.testing.assert_allclose(np.asarray(db0), np.asarray(db), rtol=1e-5)


def test_the_weight_gradient_kernel_sums_the_bias_gradient_from_the_blocks_it_reads(kernels_on_cpu):
    """``g``'s column sums (a bias's gradient) made by the tiled kernel beside ``xᵀ . g``, from rows or
    heads-first blocks: the float32 sum of ``g``, the weight's gradient unchanged; through ``int8_dot`` the
    backward has no reduction of its own over ``g``."""
    x, w, g = _operands(1024, 256, 384)
    dw = int8_pallas.tiles_matmul(x, g, jnp.float32, interpret=True)
    dw2, sums = int8_pallas.tiles_matmul(x, g, jnp.float32, interpret=True, g_sums=True)
    heads = g.reshape(4, 256, 6, 64).transpose(0, 2, 1, 3)  # as the attention's backward writes a query's gradient
    dw3, sums3 = int8_pallas.tiles_matmul(x, heads, jnp.float32, interpret=True, g_sums=True)
    exact = np.asarray(g, np.float32).sum(0, keepdims=True)
    np.testing.assert_array_equal(np.asarray(dw2), np.asarray(dw))
    np.testing.assert_array_equal(np.asarray(dw3), np.asarray(dw))
    for got in (sums, sums3):
        assert got.shape == (1, 384) and got.dtype == jnp.float32
        np.testing.assert_allclose(np.asarray(got), exact, rtol=1e-5, atol=1e-4)
    b = jnp.zeros((1, 1, 6, 64), jnp.float32)
    dims = (((2,), (0,)), ((), ()))
    pull = jax.vjp(lambda a, c, d: int8_dot(a, c, dims, jnp.bfloat16, bias=d), x.reshape(4, 256, 256),
                   w.reshape(256, 6, 64), b)[1]
    jaxpr = jax.make_jaxpr(pull)(g.reshape(4, 256, 6, 64)).jaxpr
    assert [len(e.outvars) for e in pallas_calls(jaxpr, "int8_tiles_matmul")] == [2]
    assert not [e for e in all_eqns(jaxpr) if e.primitive.name == "reduce_sum" and e.invars[0].aval.size == g.size]
    np.testing.assert_allclose(np.asarray(pull(g.reshape(4, 256, 6, 64))[2]).reshape(1, 384), exact, rtol=1e-5,
                               atol=1e-4)


def test_a_product_to_heads_is_written_heads_first_with_the_same_values(kernels_on_cpu):
    """A ``(batch, length, heads, head size)`` product (a DenseGeneral to heads, a fused query-key-value's
    part) is written by the row kernel as ``(batch, heads, length, head size)``, the layout the attention
    kernel reads, and viewed as traced: the same values as the rows' layout, bit for bit."""
    x, w, g = _operands(512, 256, 384)
    x3, w3, dims = x.reshape(2, 256, 256), w.reshape(256, 6, 64), (((2,), (0,)), ((), ()))
    q_w, s_w = quantized_along(w, (0,))
    rows = int8_pallas.rows_matmul(x, q_w, s_w, jnp.bfloat16, interpret=True)
    heads = int8_pallas.rows_matmul(x, q_w, s_w, jnp.bfloat16, interpret=True, heads_first=(256, 6))
    assert heads.shape == (2, 6, 256, 64)
    np.testing.assert_array_equal(np.asarray(heads), np.asarray(rows.reshape(2, 256, 6, 64).transpose(0, 2, 1, 3)))
    jaxpr = str(jax.make_jaxpr(lambda a, b: int8_dot(a, b, dims, jnp.bfloat16))(x3, w3))
    assert "bf16[2,6,256,64]" in jaxpr  # the kernel's result, heads-first
    y = int8_dot(x3, w3, dims, jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(rows.reshape(2, 256, 6, 64)))
    # the blocks: a row block within one sequence, whole heads of 128 columns or all of them
    assert int8_pallas.heads_blocks(512, 256, 384, 256, 6) == (256, 6)
    assert int8_pallas.heads_blocks(16384, 768, 768, 1024, 12) is not None
    assert int8_pallas.heads_blocks(512, 256, 384, 100, 6) is None  # a sequence no row block divides


def test_a_gradient_to_heads_is_read_heads_first_by_both_backward_kernels(kernels_on_cpu):
    """The backward of a product to heads reads its output gradient heads-first (as the attention's backward
    writes it): the input's gradient the same values as from the rows' layout, the weight's too (the same
    tiles, each column's scales its own)."""
    x, w, g = _operands(512, 256, 384)
    x3, w3, g4 = x.reshape(2, 256, 256), w.reshape(256, 6, 64), g.reshape(2, 256, 6, 64)
    dims = (((2,), (0,)), ((), ()))
    backward = Backward(fallback=np.dtype(jnp.bfloat16))
    pull = jax.vjp(lambda a, b: int8_dot(a, b, dims, jnp.bfloat16, backward), x3, w3)[1]
    dx, dw = pull(g4)
    jaxpr = str(jax.make_jaxpr(pull)(g4))
    # the gradient transposed heads-first (a transpose XLA folds into the attention's), never laid out as rows
    assert "bf16[2,6,256,64] = transpose" in jaxpr and "bf16[512,384]" not in jaxpr
    rows_dx, _ = int8_tpu._input_gradient(g, w, jnp.bfloat16)
    rows_dw = int8_pallas.tiles_matmul(x, g, jnp.float32, interpret=True)
    np.testing.assert_array_equal(np.asarray(dx), np.asarray(rows_dx.reshape(2, 256, 256)))
    np.testing.assert_array_equal(np.asarray(dw, np.float32), np.asarray(rows_dw.reshape(256, 6, 64), np.float32))


def test_an_attention_output_reshaped_into_its_projection_is_read_heads_first(kernels_on_cpu, monkeypatch):
    """``out.reshape(batch, length, features)`` of an attention's output, then a Dense (this project's GPT,
    nanoGPT): the int8 product reads the output before the reshape, contracting (heads, head size), so
    that on a TPU its kernel reads it heads-first, as the attention kernel writes it; the same values and
    gradients as the product of the reshaped input."""
    from precision.autocast.scaled import int8_sites
    from train.models.gpt import CausalSelfAttention

    x = jax.random.normal(jax.random.key(0), (2, 256, 256))
    model = CausalSelfAttention(num_heads=4)
    params = model.init(jax.random.key(1), x)["params"]

    def traced():
        fn = precision.autocast(lambda p: model.apply({"params": p}, x), "mixed_int8")
        return jax.value_and_grad(lambda p: jnp.mean(fn(p).astype(jnp.float32) ** 2))

    loss = traced()
    # the projection's forward and weight-gradient kernels read a 4-D (heads-first) input
    assert _kernels_reading_heads(jax.make_jaxpr(loss)(params).jaxpr) == {"int8_rows_matmul": 1, "int8_tiles_matmul": 1}
    value, grads = loss(params)
    monkeypatch.setattr(int8_sites, "heads_inputs", lambda jaxpr: {})
    loss = traced()
    value0, grads0 = loss(params)
    assert _kernels_reading_heads(jax.make_jaxpr(loss)(params).jaxpr) == {}
    np.testing.assert_array_equal(np.asarray(value), np.asarray(value0))
    for a, b in zip(jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(grads0)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _kernels_reading_heads(jaxpr) -> dict:
    """How many Pallas calls of each kernel read a 4-D (heads-first) first operand, sub-programs included."""
    return dict(Counter(str(e.params["name"]) for e in pallas_calls(jaxpr) if e.invars[0].aval.ndim == 4))


def test_a_dense_general_to_heads_adds_its_bias_in_its_kernel(kernels_on_cpu, monkeypatch):
    """A DenseGeneral query, key or value (Flax's attention) and its bias: the int8 kernel adds the bias
    before writing its result heads-first (after it, the add would be a pass of its own over that
    layout); the same values as the add after the product, the bias's gradient summed in float32."""
    import flax.linen as nn

    from precision.autocast.scaled import int8_sites

    x = jax.random.normal(jax.random.key(0), (2, 256, 256))
    model = nn.DenseGeneral((4, 64), bias_init=nn.initializers.normal(0.5))
    params = model.init(jax.random.key(1), x)["params"]

    def traced():
        fn = precision.autocast(lambda p: model.apply({"params": p}, x), "mixed_int8")
        return jax.value_and_grad(lambda p: jnp.mean(jnp.sin(fn(p).astype(jnp.float32))))

    assert _rows_kernels(jax.make_jaxpr(traced())(params).jaxpr) == [((2, 4, 256, 64), 4)]  # x, w, scales, bias
    value, grads = traced()(params)
    monkeypatch.setattr(int8_sites, "bias_epilogues", lambda jaxpr, taken: {})
    assert _rows_kernels(jax.make_jaxpr(traced())(params).jaxpr) == [((2, 4, 256, 64), 3)]
    value0, grads0 = traced()(params)
    np.testing.assert_allclose(float(value), float(value0), rtol=1e-3)
    for a, b in zip(jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(grads0)):
        assert float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b)) < 0.01  # one rounding of the result fewer


def _rows_kernels(jaxpr) -> list:
    """(result shape, operand count) of each row kernel writing a 4-D (heads-first) result."""
    return [(tuple(e.outvars[0].aval.shape), len(e.invars)) for e in pallas_calls(jaxpr, "int8_rows_matmul")
            if e.outvars[0].aval.ndim == 4]
