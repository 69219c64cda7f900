"""A fused projection split after its matmul (query, key and value made by one matmul) is one
matmul per part where lowered for a TPU (precision.autocast.projection_split): the pattern as
models write it, the same values and gradients either way, the other platforms' program and
explain unchanged, and where it is left as written.

The TPU branch runs on a CPU here by choosing it at trace time (``platform_dependent``
replaced); tests/test_tpu_compile.py reads the v5e program's products.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend.core import Literal

import precision
from helpers import all_eqns, pallas_calls
from precision.autocast import projection_split
from train.models.gpt import CausalSelfAttention

B, T, C = 2, 16, 64


class HuggingFaceStyle(nn.Module):
    """GPT-2's attention input as Hugging Face's Flax GPT-2 writes it: a ``Conv1D`` kernel held
    ``(features, in)`` and transposed, the bias added, split along features, each part to heads."""

    heads: int = 4

    @nn.compact
    def __call__(self, x):
        kernel = self.param("kernel", nn.initializers.normal(0.05), (3 * C, C))
        bias = self.param("bias", nn.initializers.normal(0.05), (3 * C,))
        y = jax.lax.dot_general(x, kernel.T, (((x.ndim - 1,), (0,)), ((), ()))) + bias
        q, k, v = (p.reshape(*x.shape[:2], self.heads, C // self.heads) for p in jnp.split(y, 3, axis=2))
        return jax.nn.dot_product_attention(q, k, v, is_causal=True).reshape(x.shape)


class GroupedQKV(nn.Module):
    """One matmul making 4 query heads and 2 key and 2 value heads (grouped-query attention):
    parts of unequal sizes, no bias."""

    @nn.compact
    def __call__(self, x):
        w = self.param("w", nn.initializers.normal(0.05), (C, 8 * 16))
        q, k, v = jnp.split((x @ w).reshape(*x.shape[:2], 8, 16), [4, 6], axis=2)
        k, v = jnp.repeat(k, 2, axis=2), jnp.repeat(v, 2, axis=2)
        return jax.nn.dot_product_attention(q, k, v, is_causal=True).reshape(*x.shape[:2], 64)


class FusedKeptWhole(nn.Module):
    """The fused result read whole as well as split: nothing to gain, left as written."""

    @nn.compact
    def __call__(self, x):
        qkv = nn.Dense(3 * C)(x)
        q, k, v = jnp.split(qkv.reshape(*x.shape[:2], 12, 16), 3, axis=2)
        out = jax.nn.dot_product_attention(q, k, v).reshape(x.shape)
        return out + qkv[..., :C]


MODELS = {"this project's GPT (reshape, then split)": lambda: CausalSelfAttention(num_heads=4),
          "Hugging Face's GPT-2 (split, then each part to heads)": HuggingFaceStyle,
          "grouped query, key, value (unequal parts)": GroupedQKV}


def _x(seed=0):
    return jax.random.normal(jax.random.key(seed), (B, T, C))


@pytest.fixture(autouse=True)
def _any_size(monkeypatch):
    """These models are far below the sizes where the split pays (test_small_products_...)."""
    monkeypatch.setattr(projection_split, "MIN_ELEMENTS", 0)
    monkeypatch.setattr(projection_split, "MIN_ROWS_PER_INPUT", 0)


def _tpu_branch(*operands, default, **branches):
    """``platform_dependent`` lowered for a TPU: every branch traced, the TPU's taken."""
    default(*operands)
    return branches["tpu"](*operands)


def _autocast(model, policy, split):
    x = _x()
    params = model.init(jax.random.key(1), x)["params"]
    return params, precision.autocast(lambda p: model.apply({"params": p}, x), policy,
                                      ops=precision.op_lists(split_projections=split))


def _run(model, policy, tpu, split=True):
    """The model's output and its params' gradients under ``policy``, lowered as for a TPU or not."""
    params, fn = _autocast(model, policy, split)

    def loss(p):
        out = fn(p)
        return jnp.mean(out.astype(jnp.float32) ** 2), out

    with pytest.MonkeyPatch.context() as m:
        if tpu:
            m.setattr(projection_split, "platform_dependent", _tpu_branch)
        (_, out), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
    return out, grads, _program(model, policy, tpu, split)


def _program(model, policy, tpu, split=True, mesh=None):
    """The autocast program, traced under ``mesh`` (abstract: no devices) when given."""
    params, fn = _autocast(model, policy, split)
    with pytest.MonkeyPatch.context() as m:
        if tpu:
            m.setattr(projection_split, "platform_dependent", _tpu_branch)
        if mesh is None:
            return jax.make_jaxpr(fn)(params)
        with jax.sharding.use_abstract_mesh(mesh):
            return jax.make_jaxpr(fn)(params)


def _products(jaxpr):
    """dot_general equations of a program, sub-programs included."""
    return sum(e.primitive.name == "dot_general" for e in all_eqns(jaxpr))


def _assert_close(actual, desired, rel):
    """Each leaf within ``rel`` of its largest magnitude: XLA may sum a narrower product in another
    order (rounding, then bfloat16's), never moves a column to another part's place."""
    for a, d in zip(jax.tree_util.tree_leaves(actual), jax.tree_util.tree_leaves(desired), strict=True):
        a, d = np.asarray(a, np.float32), np.asarray(d, np.float32)
        assert np.max(np.abs(a - d)) <= rel * np.max(np.abs(d)), (np.max(np.abs(a - d)), np.max(np.abs(d)))


def _plan(model):
    x = _x()
    params = model.init(jax.random.key(1), x)
    return projection_split.plan(jax.make_jaxpr(lambda p: model.apply(p, x))(params).jaxpr, set())


@pytest.mark.parametrize("name", list(MODELS))
def test_the_pattern_is_found_as_models_write_it(name):
    (split,) = _plan(MODELS[name]()).values()
    assert len(split.columns) == 3 and split.columns[-1][1] == 8 * 16 if name.startswith("grouped") else 3 * C
    assert [tuple(v.aval.shape[2:]) for v in split.outs] == ([(4, 16), (2, 16), (2, 16)] if name.startswith("grouped")
                                                             else [(4, 16)] * 3)
    assert (split.add is None) == name.startswith("grouped")


def test_a_fused_result_read_whole_too_is_left_as_written():
    assert _plan(FusedKeptWhole()) == {}


@pytest.mark.parametrize("name,policy", [(name, policy) for name in MODELS for policy in ("mixed_bf16", "mixed_int8")]
                         + [(next(iter(MODELS)), "f32")])
def test_the_parts_made_apart_give_the_same_values_and_gradients(name, policy):
    out, grads, _ = _run(MODELS[name](), policy, tpu=False)
    tpu_out, tpu_grads, tpu_jaxpr = _run(MODELS[name](), policy, tpu=True)
    _, _, whole = _run(MODELS[name](), policy, tpu=True, split=False)
    # each output is the same dot product, whichever matmul makes it
    _assert_close((tpu_out, tpu_grads), (out, grads), 1e-5 if policy == "f32" else 2e-2)
    assert not np.allclose(np.asarray(out, np.float32), 0)
    # the TPU branch's program: one product per part, instead of the one (and the other branch's,
    # unused: XLA drops it; int8: each product the recipe's own)
    if policy == "mixed_int8":
        assert _products(tpu_jaxpr) > _products(whole)
    else:
        assert _products(tpu_jaxpr) == _products(whole) + 3


def test_other_platforms_run_the_program_as_written_and_explain_says_what_it_said():
    model = CausalSelfAttention(num_heads=4)
    x = _x()
    params = model.init(jax.random.key(1), x)["params"]
    lowered = {}
    for split in (True, False):
        ops = precision.op_lists(split_projections=split)
        fn = jax.jit(precision.autocast(lambda p: model.apply({"params": p}, x), "mixed_bf16", ops=ops))
        lowered[split] = (fn.lower(params).compile().as_text().count(" dot("), np.asarray(fn(params), np.float32))
        explanation = precision.explain(model, x, policy="mixed_bf16", ops=ops)
        lowered[split] += (str(explanation),)
    assert lowered[True][0] == lowered[False][0] and lowered[True][2] == lowered[False][2]
    np.testing.assert_array_equal(lowered[True][1], lowered[False][1])


def test_left_as_written_for_fp8_products():
    model = CausalSelfAttention(num_heads=4)  # an FP8 product's scaling state is its own: one product
    assert _products(_program(model, "mixed_fp8", tpu=True)) == _products(_program(model, "mixed_fp8", True, False))


def test_small_products_and_programs_over_several_devices_are_left_as_written(monkeypatch):
    model = CausalSelfAttention(num_heads=4)
    one = _program(model, "mixed_bf16", tpu=True)
    sharded = _program(model, "mixed_bf16", tpu=True, mesh=jax.sharding.AbstractMesh((2,), ("data",)))
    assert _products(sharded) == _products(one) - 3  # a sharded weight's columns would move between devices
    # a product of 32 x 192 elements, of 32 rows for 64 inputs (modeled: the products and weight slices it
    # adds cost more than the copies it saves below 10 Mi elements or 8 rows per input)
    monkeypatch.setattr(projection_split, "MIN_ELEMENTS", 32 * 192 + 1)
    assert _products(_program(model, "mixed_bf16", tpu=True)) == _products(one) - 3
    monkeypatch.setattr(projection_split, "MIN_ELEMENTS", 0)
    monkeypatch.setattr(projection_split, "MIN_ROWS_PER_INPUT", 1)
    assert _products(_program(model, "mixed_bf16", tpu=True)) == _products(one) - 3


def test_turned_off_it_is_one_product_on_a_tpu_too():
    model = CausalSelfAttention(num_heads=4)
    off, on = _program(model, "mixed_bf16", True, split=False), _program(model, "mixed_bf16", True)
    assert _products(on) == _products(off) + 3
    assert precision.op_lists().split_projections and not precision.op_lists(split_projections=False).split_projections


def test_an_int8_part_adds_its_bias_in_its_kernel_with_the_same_values_and_gradients(monkeypatch):
    """On a TPU each int8 part's row kernel adds the part's bias before rounding its result (else XLA
    adds it in a pass of its own, fused into the layout copy to heads-first at vector cost); values
    and gradients as the program as written, on this CPU (the kernels interpreted)."""
    import functools

    from precision.autocast.scaled import int8_pallas, int8_tpu

    x = jax.random.normal(jax.random.key(0), (2, 64, 128))
    model = CausalSelfAttention(num_heads=4)
    params = model.init(jax.random.key(1), x)["params"]

    def loss(split):
        ops = precision.op_lists(split_projections=split)
        fn = precision.autocast(lambda p: model.apply({"params": p}, x), "mixed_int8", ops=ops)
        return jax.value_and_grad(lambda p: jnp.mean(fn(p).astype(jnp.float32) ** 2))

    exact = jax.value_and_grad(lambda p: jnp.mean(model.apply({"params": p}, x) ** 2))(params)[1]
    monkeypatch.setattr(projection_split, "platform_dependent", _tpu_branch)
    monkeypatch.setattr(int8_tpu, "choose", lambda kernel, fallback, *args: kernel(*args))
    for name in ("rows_matmul", "tiles_matmul"):
        monkeypatch.setattr(int8_tpu, name, functools.partial(getattr(int8_pallas, name), interpret=True))
    rows = [len(e.invars) for e in pallas_calls(jax.make_jaxpr(loss(True))(params).jaxpr, "int8_rows_matmul")]
    # forward: the three parts and the output projection with their biases, the other branch's fused product
    # (traced, unused) without; backward: four input gradients
    assert sorted(rows) == [3] * 5 + [4] * 4
    # against the same kernels on the one fused product, its bias added by its kernel too (each column's
    # scales are its own); the bias's gradient summed in float32 by the weight gradient's kernels; the
    # query's scale taken into its part's weight and bias (one rounding of the query fewer)
    (value, grads), (value0, grads0) = loss(True)(params), loss(False)(params)
    _assert_close((value, grads), (value0, grads0), 2e-2)
    for name in ("bias", "kernel"):
        err = lambda g: float(jnp.linalg.norm(g["qkv"][name] - exact["qkv"][name])  # noqa: E731
                              / jnp.linalg.norm(exact["qkv"][name]))
        assert err(grads) <= err(grads0) * 1.01 and err(grads) < 0.03


@pytest.mark.parametrize("policy, folded", [("mixed_int8", True), ("mixed_bf16", False)])
def test_a_scaled_query_takes_its_scale_into_its_int8_parts_weight(monkeypatch, policy, folded):
    """``q * head_size ** -0.5`` after the split: an int8 part makes ``x . (c w) + c b`` (its weight and bias
    scaled, weight-sized passes; no pass over the query, which the int8 kernel writes heads-first and XLA
    cannot fuse a multiply into); a bf16 part multiplies after its product as written (XLA fuses it). The
    same loss within a rounding."""
    x = jax.random.normal(jax.random.key(0), (2, 64, 128))
    model = CausalSelfAttention(num_heads=4)  # head size 32: a scale no power of two
    params = model.init(jax.random.key(1), x)["params"]
    monkeypatch.setattr(projection_split, "platform_dependent", _tpu_branch)
    fn = precision.autocast(lambda p: model.apply({"params": p}, x), policy)
    jaxpr = jax.make_jaxpr(fn)(params).jaxpr

    def scaled_queries(eqns):  # a (batch, length, heads, head size) value multiplied by a scalar
        return [e for e in eqns if e.primitive.name == "mul" and any(
            isinstance(v, Literal) and v.aval.shape == () for v in e.invars) and e.outvars[0].aval.shape == (2, 64, 4, 32)]

    # the TPU branch (traced second) scales no query; the other, as written, does
    tpu_branch = [e for e in all_eqns(jaxpr) if e.primitive.name in ("mul",)]
    assert len(scaled_queries(tpu_branch)) == (1 if folded else 2)
    as_written = precision.autocast(lambda p: model.apply({"params": p}, x), policy,
                                    ops=precision.op_lists(split_projections=False))
    np.testing.assert_allclose(np.asarray(fn(params), np.float32), np.asarray(as_written(params), np.float32),
                               atol=0.05 * float(jnp.max(jnp.abs(as_written(params)))))
