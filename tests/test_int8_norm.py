"""A layer or RMS norm read by an int8 product, applied by the product's own kernels
(precision.autocast.scaled.int8_norm): the norm as the model computes it, found with its epsilon, and
through the kernels (interpreted on this CPU) or the recipe the loss and gradients of the model as
written, the norm's scale and offset included, within a rounding."""

import flax.linen as nn
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import precision
from helpers import pallas_calls
from precision.autocast.norm_pattern import find_norms
from precision.autocast.scaled import int8_norm
from precision.autocast.scaled.int8_norm import RowNorm, row_norm

NORMS = {"layer": lambda: nn.LayerNorm(epsilon=1e-5), "rms": lambda: nn.RMSNorm(epsilon=1e-6),
         "no_scale": lambda: nn.LayerNorm(use_scale=False)}


class PreNorm(nn.Module):
    """A transformer's pre-norm projection as people write it: a norm, then a Dense reading it."""

    norm: str = "layer"

    @nn.compact
    def __call__(self, x):
        h = nn.Dense(256)(x)  # the residual stream, held in bf16 under the policy
        return nn.Dense(512)(NORMS[self.norm]()(h))


def _traced(model, x, policy="mixed_int8"):
    params = model.init(jax.random.key(1), x)["params"]
    # a trained norm's scale and offset are not ones and zeros
    params = jax.tree_util.tree_map_with_path(
        lambda path, p: p + 0.3 * jax.random.normal(jax.random.key(len(str(path))), p.shape)
        if "Norm" in str(path[0]) else p, params)
    fn = precision.autocast(lambda p: model.apply({"params": p}, x), policy)
    return params, jax.value_and_grad(lambda p: jnp.mean(jnp.sin(fn(p).astype(jnp.float32))))


@pytest.mark.parametrize("name", ["layer", "rms"])
def test_a_row_norm_is_the_models_norm_found_with_its_epsilon_forward_and_backward(name):
    x = jax.random.normal(jax.random.key(0), (2, 8, 128)) * 3 + 1
    module = NORMS[name]()
    params = module.init(jax.random.key(1), x)["params"]
    params = jax.tree_util.tree_map(lambda p: p + 0.1 * jax.random.normal(jax.random.key(2), p.shape), params)
    fn = lambda x, p: module.apply({"params": p}, x)  # noqa: E731
    norms = find_norms(jax.make_jaxpr(fn)(x, params).jaxpr)
    assert len(norms) == 1 and norms[0].eps == pytest.approx(module.epsilon)
    row = row_norm(norms[0])
    assert row is not None and row.centred == (name == "layer") and row.params == (2 if name == "layer" else 1)
    given = [params["scale"]] + ([params["bias"]] if name == "layer" else [])
    np.testing.assert_allclose(row(x, *given), fn(x, params), rtol=1e-5, atol=1e-5)
    d = jax.random.normal(jax.random.key(3), x.shape)
    want = jax.vjp(fn, x, params)[1](d)
    got = row.backward(x, d, *given)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(got[1], want[1]["scale"], rtol=1e-4, atol=1e-4)
    if name == "layer":
        np.testing.assert_allclose(got[2], want[1]["bias"], rtol=1e-4, atol=1e-4)


def test_a_norm_over_other_axes_or_with_a_param_varying_along_rows_is_not_a_row_norm():
    x = jnp.ones((2, 8, 128))
    over_two = nn.LayerNorm(reduction_axes=(-2, -1), feature_axes=(-2, -1))
    params = over_two.init(jax.random.key(0), x)
    (norm,) = find_norms(jax.make_jaxpr(lambda x: over_two.apply(params, x))(x).jaxpr)
    assert row_norm(norm) is None


@pytest.mark.parametrize("name", ["layer", "rms", "no_scale"])
def test_through_the_kernels_the_product_normalizes_its_input_with_the_gradients_of_the_model(
        kernels_on_cpu, monkeypatch, name):
    """The second Dense's forward kernel reads the first's result and the norm's params (no pass of the norm
    between them), its input gradient kernel writes the first's result's gradient and the params' partial
    sums, its weight gradient kernel normalizes its tiles; the loss and gradients (the norm's scale and
    offset too) as the program without it within a rounding, as close to float32's."""
    x = jax.random.normal(jax.random.key(0), (2, 256, 128))
    params, loss = _traced(PreNorm(name), x)
    calls = [(str(e.params["name"]), [v.aval.shape for v in e.invars], len(e.outvars))
             for e in pallas_calls(jax.make_jaxpr(loss)(params).jaxpr)]
    count = {"layer": 2, "rms": 1, "no_scale": 1}[name]
    rows = [c for c in calls if c[0] == "int8_rows_matmul"]
    forward = [c for c in rows if c[1][0] == (512, 256) and c[2] == 1 and len(c[1]) == 4 + count]
    backward = [c for c in rows if c[2] == 1 + count]
    assert len(forward) == 1 and forward[0][1][-1] == (1, 256)  # Dense_1 reads Dense_0's result, the params
    assert len(backward) == 1 and backward[0][1][3] == (512, 256)  # through the norm at Dense_0's result
    tiles = [c for c in calls if c[0] == "int8_tiles_matmul"]
    assert sorted(len(c[1]) for c in tiles) == [2, 2 + count]  # Dense_1's tiles normalized
    value, grads = loss(params)
    monkeypatch.setattr(int8_norm, "row_norm", lambda norm: None)
    value0, grads0 = _traced(PreNorm(name), x)[1](params)
    exact = jax.grad(lambda p: jnp.mean(jnp.sin(PreNorm(name).apply({"params": p}, x))))(params)
    np.testing.assert_allclose(float(value), float(value0), rtol=2e-3, atol=2e-4)  # a mean near 0
    rel = lambda a, b: float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))  # noqa: E731
    flat = [jax.tree_util.tree_leaves_with_path(t) for t in (grads, grads0, exact)]
    for (path, a), (_, b), (_, c) in zip(*flat):
        assert rel(a, b) < 0.03 and rel(a, c) < 1.1 * rel(b, c) + 3e-3, (path, rel(a, b), rel(a, c), rel(b, c))


def test_without_kernels_the_recipe_normalizes_in_float32_and_trains_as_written(monkeypatch):
    """On a CPU (the recipe): the product quantizes the norm computed in float32 from its input, and the
    norm's params get their gradients from the product; loss and gradients those of the model as written
    within a rounding."""
    x = jax.random.normal(jax.random.key(0), (2, 128, 128))
    params, loss = _traced(PreNorm(), x)
    value, grads = loss(params)
    assert float(jnp.abs(grads["LayerNorm_0"]["scale"]).sum()) > 0
    monkeypatch.setattr(int8_norm, "row_norm", lambda norm: None)
    value0, grads0 = _traced(PreNorm(), x)[1](params)
    np.testing.assert_allclose(float(value), float(value0), rtol=2e-3, atol=2e-4)
    for a, b in zip(jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(grads0)):
        assert float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b)) < 0.03


def test_only_an_int8_policy_marks_a_norms_result(monkeypatch):
    """Under bf16 the norm is the model's equations (and its closed-form backward), as before."""
    asked = []
    monkeypatch.setattr(int8_norm, "row_norm", lambda norm, found=row_norm: asked.append(found(norm)) or asked[-1])
    x = jnp.ones((2, 128, 128))
    for policy in ("mixed_bf16", "mixed_int8"):
        params, loss = _traced(PreNorm(), x, policy)
        jax.make_jaxpr(loss)(params)
        asked.append(policy)
    assert asked[0] == "mixed_bf16" and isinstance(asked[1], RowNorm) and asked[-1] == "mixed_int8"


class PinnedPreNorm(nn.Module):
    """The same, written with every dtype pinned to float32 (as many codebases do)."""

    @nn.compact
    def __call__(self, x):
        h = nn.Dense(256, dtype=jnp.float32, param_dtype=jnp.float32)(x)
        h = nn.LayerNorm(dtype=jnp.float32, param_dtype=jnp.float32)(h)
        return nn.Dense(512, dtype=jnp.float32, param_dtype=jnp.float32)(h)


class NNXPreNorm(nnx.Module):
    """An NNX pre-norm projection, dtypes pinned."""

    def __init__(self, rngs):
        self.inp = nnx.Linear(128, 256, dtype=jnp.float32, rngs=rngs)
        self.norm = nnx.LayerNorm(256, dtype=jnp.float32, rngs=rngs)
        self.out = nnx.Linear(256, 512, dtype=jnp.float32, rngs=rngs)

    def __call__(self, x):
        return self.out(self.norm(self.inp(x)))


def test_models_with_pinned_dtypes_linen_and_nnx_have_the_norm_applied_by_the_product_and_train_as_float32(
        monkeypatch):
    """A pinned float32 Linen model and an NNX one: the norm is marked for the int8 product, the products
    are int8, and the norm's params get gradients as close to float32's as the int8 products allow."""
    asked = []
    monkeypatch.setattr(int8_norm, "row_norm", lambda norm, found=row_norm: asked.append(found(norm)) or asked[-1])
    x = jax.random.normal(jax.random.key(0), (2, 128, 128))
    params, loss = _traced(PinnedPreNorm(), x)
    _, grads = loss(params)
    exact = jax.grad(lambda p: jnp.mean(jnp.sin(PinnedPreNorm().apply({"params": p}, x))))(params)
    assert asked and isinstance(asked[-1], RowNorm)
    rel = lambda a, b: float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))  # noqa: E731
    for a, b in zip(jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(exact)):
        assert rel(a, b) < 0.05
    asked.clear()
    model = precision.with_policy(NNXPreNorm(nnx.Rngs(0)), "mixed_int8")
    assert precision.explain(model, x).int8_share == 1.0 and isinstance(asked[-1], RowNorm)
    reference = NNXPreNorm(nnx.Rngs(0))
    d = nnx.grad(lambda m: jnp.mean(jnp.sin(m(x).astype(jnp.float32))))(model)
    e = nnx.grad(lambda m: jnp.mean(jnp.sin(m(x))))(reference)
    leaves = [jax.tree_util.tree_leaves(nnx.state(g, nnx.Param)) for g in (d, e)]
    for a, b in zip(*leaves):
        assert a.dtype == jnp.float32 and rel(a, b) < 0.05
