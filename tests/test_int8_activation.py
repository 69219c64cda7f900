"""An activation between two projections applied by the second's int8 kernels, and a Dense's bias added and
summed by its own (precision.autocast.scaled.int8_activation, int8_sites.bias_epilogues): found in the
programs models write, the same functions as the model's, and through the kernels (interpreted on this
CPU) the gradients of the model as written, within a rounding."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import precision
from helpers import pallas_calls
from precision.autocast.scaled import int8_sites
from precision.autocast.scaled.int8_activation import activation_prologues


class MLP(nn.Module):
    """A transformer's MLP as people write it: Dense, an activation, Dense."""

    activation: str = "gelu"

    @nn.compact
    def __call__(self, x):
        act = {"gelu": nn.gelu, "relu": nn.relu, "silu": nn.silu, "tanh": jnp.tanh}[self.activation]
        return nn.Dense(256)(act(nn.Dense(512)(x)))


def _traced(model, x, policy="mixed_int8"):
    params = model.init(jax.random.key(1), x)["params"]
    fn = precision.autocast(lambda p: model.apply({"params": p}, x), policy)
    return params, jax.value_and_grad(lambda p: jnp.mean(jnp.sin(fn(p).astype(jnp.float32))))


@pytest.mark.parametrize("name", ["gelu", "silu", "tanh"])
def test_an_activation_between_two_dense_layers_is_found_and_is_the_models_function(name):
    x = jnp.ones((2, 128, 64))
    model = MLP(name)
    jaxpr = jax.make_jaxpr(lambda p: model.apply({"params": p}, x))(model.init(jax.random.key(0), x)["params"]).jaxpr
    found = activation_prologues(jaxpr)
    (index, act), = found.items()
    assert jaxpr.eqns[index].primitive.name == "dot_general" and act.root.aval.shape == (2, 128, 512)
    fn = {"gelu": nn.gelu, "relu": nn.relu, "silu": nn.silu, "tanh": jnp.tanh}[name]
    h = jax.random.normal(jax.random.key(2), (16, 256)) * 3  # any shape: a kernel's block
    np.testing.assert_allclose(np.asarray(act(h)), np.asarray(fn(h)), rtol=1e-6, atol=1e-6)
    d = jax.random.normal(jax.random.key(3), h.shape)
    np.testing.assert_allclose(np.asarray(act.backward(h, d)[0]), np.asarray(jax.vjp(fn, h)[1](d)[0]), rtol=1e-5,
                               atol=1e-6)


def test_a_chain_whose_values_are_read_elsewhere_or_that_mixes_two_values_is_not_an_activation():
    w = jnp.ones((64, 32))

    def read_twice(h):  # the activation's result also leaves: it must be written
        a = jnp.tanh(h) * 2.0
        return a @ w, a

    def two_inputs(h, g):  # a gate (SwiGLU): two values, not one's activation
        return (jax.nn.silu(g) * h) @ w

    def inner_read(h):  # an intermediate of the chain read by another equation
        t = jnp.tanh(h)
        return (t * 0.5 + 0.5) @ w, t

    def one_input(h):
        return (jax.nn.relu(h) * 0.5) @ w

    h = jnp.ones((8, 64))
    for fn, args, want in ((read_twice, (h,), 0), (two_inputs, (h, h), 0), (inner_read, (h,), 0), (one_input, (h,), 1)):
        assert len(activation_prologues(jax.make_jaxpr(fn)(*args).jaxpr)) == want, fn.__name__


@pytest.mark.parametrize("name", ["gelu", "silu"])
def test_through_the_kernels_the_second_product_applies_the_activation_with_the_gradients_of_the_model(
        kernels_on_cpu, monkeypatch, name):
    """The second Dense's forward kernel reads the first's result (no pass of the activation between them),
    its input gradient kernel reads it too and writes the first's result's gradient, its weight gradient
    kernel applies the activation to its tiles, and both biases are added and summed by the kernels; the
    loss and gradients as the unfused program's within a rounding, as close to float32's."""
    x = jax.random.normal(jax.random.key(0), (2, 256, 256))
    params, loss = _traced(MLP(name), x)
    calls = [(str(e.params["name"]), [v.aval.shape for v in e.invars], len(e.outvars))
             for e in pallas_calls(jax.make_jaxpr(loss)(params).jaxpr)]
    rows = [c for c in calls if c[0] == "int8_rows_matmul"]
    # forward: Dense_0 (x, w, scales, bias), Dense_1 reading Dense_0's (m, 512) result; backward: Dense_1's
    # input gradient reading that result beside its output gradient
    assert [len(c[1]) for c in rows] == [4, 4, 4, 3] and rows[1][1][0] == (512, 512) and rows[2][1][3] == (512, 512)
    assert [c[2] for c in calls if c[0] == "int8_tiles_matmul"] == [2, 2]  # each with its bias's sums
    value, grads = loss(params)
    monkeypatch.setattr(int8_sites, "activation_prologues", lambda jaxpr: {})
    value0, grads0 = _traced(MLP(name), x)[1](params)
    exact = jax.grad(lambda p: jnp.mean(jnp.sin(MLP(name).apply({"params": p}, x))))(params)
    np.testing.assert_allclose(float(value), float(value0), rtol=2e-3, atol=1e-4)  # a mean near 0
    rel = lambda a, b: float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))  # noqa: E731
    for a, b, c in zip(*(jax.tree_util.tree_leaves(t) for t in (grads, grads0, exact))):
        assert rel(a, b) < 0.02 and rel(a, c) < 1.1 * rel(b, c) + 2e-3


def test_without_kernels_the_recipe_applies_the_activation_in_float32_and_trains_as_written(monkeypatch):
    """On a CPU (the recipe): the product quantizes the activation computed in float32 from its input; the
    loss and gradients those of the model as written within a rounding."""
    x = jax.random.normal(jax.random.key(0), (2, 128, 128))
    params, loss = _traced(MLP(), x)
    value, grads = loss(params)
    monkeypatch.setattr(int8_sites, "activation_prologues", lambda jaxpr: {})
    value0, grads0 = _traced(MLP(), x)[1](params)
    np.testing.assert_allclose(float(value), float(value0), rtol=2e-3, atol=1e-4)  # a mean near 0
    for a, b in zip(jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(grads0)):
        assert float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b)) < 0.02


def test_under_bf16_or_fp8_policies_nothing_changes():
    """Only an int8 policy's products take the activation: bf16's program is the model's equations."""
    x = jnp.ones((2, 128, 128))
    params, loss = _traced(MLP(), x, "mixed_bf16")
    jaxpr = str(jax.make_jaxpr(loss)(params))
    assert "tanh" in jaxpr and "pallas_call" not in jaxpr
