"""Gradients of params produced in a chosen dtype (``reduce_dtype``): the dtype a
data-parallel step reduces them across devices in. One device here; the
8-device tests (collective dtypes and bytes, training against one device, the
loss scale) are in test_communication.py and test_distributed.py."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn, nnx

import precision
from precision.autocast.program import iter_ops
from train import create_train_state
from train.parallel.distributed import Layout, make_mesh

BF16, F32 = np.dtype(jnp.bfloat16), np.dtype(np.float32)


class _TokenNet(nn.Module):
    """Embedding, biased Dense layers, a LayerNorm: each param's gradient a sum over tokens."""

    @nn.compact
    def __call__(self, ids):
        h = nn.Embed(64, 32)(ids)
        h = nn.relu(nn.LayerNorm()(nn.Dense(64)(h)))
        return nn.Dense(8)(h)


IDS = jax.random.randint(jax.random.PRNGKey(1), (8, 48), 0, 64)
NET = _TokenNet()
PARAMS = NET.init(jax.random.PRNGKey(0), IDS)["params"]


def _grads(policy, reduce_dtype, params=PARAMS):
    fn = precision.autocast(lambda p, x: NET.apply({"params": p}, x), policy, reduce_dtype=reduce_dtype)
    return jax.jit(jax.grad(lambda p: jnp.mean(fn(p, IDS).astype(jnp.float32) ** 2)))(params)


def _relative_errors(grads, reference):
    return jax.tree_util.tree_map(
        lambda g, r: float(jnp.linalg.norm((g - r).ravel()) / jnp.linalg.norm(r.ravel())), grads, reference)


def test_reduce_dtype_names_float32_bfloat16_or_float16():
    assert precision.reduce_dtype_of("f32") == F32 and precision.reduce_dtype_of("BFloat16") == BF16
    assert precision.reduce_dtype_of(jnp.float16) == np.dtype(np.float16) and precision.reduce_dtype_of(None) is None
    for bad in ("f64", "int8", 3, "f8"):
        with pytest.raises(precision.PolicyError, match="reduce_dtype: .* valid: f32, bf16, f16"):
            precision.reduce_dtype_of(bad)


def _layer(p, ids):
    x = jnp.take(p["embedding"], ids, axis=0)  # an embedding lookup: a gather
    return x @ p["kernel"] + p["bias"]  # a matmul and a broadcast bias


def _exact_sums():
    """The layer's param gradients under mixed_bf16 for a bfloat16-exact output cotangent,
    and the same bfloat16 terms summed exactly (float64)."""
    k = jax.random.split(jax.random.PRNGKey(3), 4)
    p = {"embedding": jax.random.normal(k[0], (16, 32)), "kernel": jax.random.normal(k[1], (32, 24)),
         "bias": jnp.zeros((24,))}
    ids = jax.random.randint(k[2], (12, 40), 0, 16)
    g = jax.random.normal(k[3], (12, 40, 24)).astype(jnp.bfloat16).astype(jnp.float32)
    as64 = lambda a: np.asarray(jnp.asarray(a, jnp.bfloat16).astype(jnp.float32), np.float64)  # noqa: E731
    x, g64 = as64(p["embedding"])[np.asarray(ids)], np.asarray(g, np.float64)
    d_x = as64(g64.astype(np.float32) @ as64(p["kernel"]).T)  # the activation gradient: a bfloat16 product
    d_emb = np.zeros((16, 32))
    np.add.at(d_emb, np.asarray(ids), d_x)
    exact = {"bias": g64.sum((0, 1)), "kernel": np.einsum("tsi,tso->io", x, g64), "embedding": d_emb}
    got = {}
    for reduce_dtype in (None, "f32"):
        fn = precision.autocast(_layer, "mixed_bf16", reduce_dtype=reduce_dtype)
        got[reduce_dtype] = jax.vjp(lambda q: fn(q, ids), p)[1](g)[0]
    return got, exact


def test_float32_reduction_sums_bias_matmul_and_embedding_gradients_in_float32():
    """mixed_bf16 rounds a weight gradient to bfloat16 and sums a bias's or an embedding
    row's gradient in bfloat16; reduce_dtype=f32 sums the same bfloat16 terms in float32:
    what a float64 sum gives, to float32 rounding."""
    got, exact = _exact_sums()
    for name, want in exact.items():
        error = lambda g: float(np.max(np.abs(np.asarray(g[name], np.float64) - want)) / np.max(np.abs(want)))  # noqa: E731
        assert got["f32"][name].dtype == F32
        assert error(got["f32"]) < 1e-5, (name, error(got["f32"]))
        assert error(got[None]) > 1e-3, (name, error(got[None]))  # the bfloat16 sums it replaces


def test_the_forward_pass_and_activation_gradients_are_unchanged():
    """Only params' gradients move to reduce_dtype: the outputs are bit for bit the same,
    and the backward product for an activation keeps the compute dtype."""
    outs = [precision.autocast(lambda p, x: NET.apply({"params": p}, x), "mixed_bf16", reduce_dtype=r)(PARAMS, IDS)
            for r in (None, "f32")]
    np.testing.assert_array_equal(np.asarray(outs[0]), np.asarray(outs[1]))
    fn = precision.autocast(lambda p, x: NET.apply({"params": p}, x), "mixed_bf16", reduce_dtype="f32")
    jaxpr = jax.make_jaxpr(jax.grad(lambda p: jnp.mean(fn(p, IDS).astype(jnp.float32) ** 2)))(PARAMS)
    dots = [op for op in iter_ops(jaxpr.jaxpr) if op.primitive == "dot_general"]
    kernels = {s for k in ("Dense_0", "Dense_1") for s in (PARAMS[k]["kernel"].shape, PARAMS[k]["kernel"].shape[::-1])}
    weight = [op for op in dots if tuple(op.eqn.outvars[0].aval.shape) in kernels]
    activation = [op for op in dots if op.eqn.outvars[0].aval.shape == (8, 48, 64)]  # Dense_0's output, its gradient
    assert len(weight) >= 2 and all(op.out_dtypes == (F32,) for op in weight)
    assert len(activation) >= 2 and all(op.out_dtypes == (BF16,) for op in activation)


def test_a_bfloat16_reduction_leaves_bfloat16_gradients_alone_and_rounds_float32_ones():
    """Under mixed_bf16, reduce_dtype=bf16 changes no gradient the model computes in bfloat16;
    the LayerNorm's float32 params get bfloat16 gradients too (every reduction in bfloat16)."""
    plain, half = _grads("mixed_bf16", None), _grads("mixed_bf16", "bf16")
    for name in ("Embed_0", "Dense_0", "Dense_1"):
        for x, y in zip(jax.tree_util.tree_leaves(plain[name]), jax.tree_util.tree_leaves(half[name])):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    for g in jax.tree_util.tree_leaves(half["LayerNorm_0"]):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(g.astype(jnp.bfloat16).astype(jnp.float32)))


def test_a_half_reduction_of_a_float32_model_rounds_every_param_gradient_to_it():
    """fp32 params and compute, gradients reduced in bfloat16 (as PyTorch FSDP's reduce_dtype):
    every gradient, the LayerNorm's too, is a bfloat16 value near float32's (sums over
    tokens accumulate in bfloat16: a few percent)."""
    grads, reference = _grads("fp32", "bf16"), _grads("fp32", None)
    for g in jax.tree_util.tree_leaves(grads):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(g.astype(jnp.bfloat16).astype(jnp.float32)))
    errors = jax.tree_util.tree_leaves(_relative_errors(grads, reference))
    assert 0 < max(errors) < 0.05


class _PinnedNNX(nnx.Module):
    """A user's NNX model pinned to float32, biased layers, no train keyword."""

    def __init__(self, *, rngs):
        self.l1 = nnx.Linear(16, 64, dtype=jnp.float32, param_dtype=jnp.float32, rngs=rngs)
        self.l2 = nnx.Linear(64, 4, dtype=jnp.float32, rngs=rngs)

    def __call__(self, x):
        return self.l2(nnx.relu(self.l1(x)))


def test_an_nnx_model_gets_float32_param_gradients_under_reduce_dtype():
    x = jax.random.normal(jax.random.PRNGKey(2), (64, 16))
    grads = {}
    for reduce_dtype in (None, "f32"):
        model = precision.with_policy(_PinnedNNX(rngs=nnx.Rngs(0)), "mixed_bf16", reduce_dtype=reduce_dtype)
        grads[reduce_dtype] = nnx.grad(lambda m: jnp.mean(m(x).astype(jnp.float32) ** 2))(model)
    plain, wide = (grads[r]["module"]["l1"]["bias"].value for r in (None, "f32"))
    # The float32 sum over 64 rows is not a bfloat16 value; the bfloat16 one is.
    assert not np.array_equal(np.asarray(wide), np.asarray(wide.astype(jnp.bfloat16).astype(jnp.float32)))
    np.testing.assert_array_equal(np.asarray(plain), np.asarray(plain.astype(jnp.bfloat16).astype(jnp.float32)))


def test_create_train_state_resolves_and_checks_reduce_dtype():
    one = Layout(make_mesh(1, 1, jax.devices()[:1]))
    make = lambda **kw: create_train_state(_TokenNet(), kw.pop("policy", "mixed_bf16"), optax.sgd(0.1),  # noqa: E731
                                           jax.random.PRNGKey(0), IDS[:1], **kw)
    assert make().model.reduce_dtype is None  # auto, one device: nothing is reduced
    assert make(layout=one).model.reduce_dtype is None
    assert make(reduce_dtype="f32").model.reduce_dtype == F32
    assert make(policy="fp32", reduce_dtype="bf16").model.reduce_dtype == BF16
    assert make(policy="mixed_f16", reduce_dtype="f16").model.reduce_dtype == np.dtype(np.float16)
    with pytest.raises(precision.PolicyError, match="reduce_dtype=f16 needs a loss scale"):
        make(reduce_dtype="f16")  # mixed_bf16's loss scale is none
    with pytest.raises(precision.PolicyError, match="valid: f32, bf16, f16"):
        make(reduce_dtype="f64")
    wrapped = precision.with_policy(_TokenNet(), "mixed_bf16", reduce_dtype="bf16")
    assert create_train_state(wrapped, None, optax.sgd(0.1), jax.random.PRNGKey(0), IDS[:1]).model.reduce_dtype == BF16
    assert wrapped.reduce_dtype == BF16


def test_an_explicit_broadcast_of_a_param_is_summed_in_the_reduce_dtype():
    """``x + jnp.broadcast_to(bias, x.shape)``: the sum over the batch that transposes the
    broadcast is the reduction, in float32 or in bfloat16 as asked."""
    def layer(p, x):
        return x @ p["kernel"] + jnp.broadcast_to(p["bias"], x.shape[:-1] + (24,))

    k = jax.random.split(jax.random.PRNGKey(4), 3)
    p = {"kernel": jax.random.normal(k[0], (32, 24)), "bias": jnp.zeros((24,))}
    x = jax.random.normal(k[1], (12, 40, 32))
    g = jax.random.normal(k[2], (12, 40, 24)).astype(jnp.bfloat16).astype(jnp.float32)
    exact = np.asarray(g, np.float64).sum((0, 1))
    bias = {(policy, r): jax.vjp(lambda q: precision.autocast(layer, policy, reduce_dtype=r)(q, x), p)[1](g)[0]["bias"]
            for policy, r in (("mixed_bf16", "f32"), ("fp32", "bf16"))}
    wide = bias["mixed_bf16", "f32"]
    assert np.max(np.abs(np.asarray(wide, np.float64) - exact)) < 1e-5 * np.abs(exact).max()
    half = bias["fp32", "bf16"]
    np.testing.assert_array_equal(np.asarray(half), np.asarray(half.astype(jnp.bfloat16).astype(jnp.float32)))


def test_a_position_table_read_at_constant_indices_is_summed_over_the_batch_in_the_reduce_dtype():
    """``x + positions[arange(length)]`` (GPT's learned positions): the rows are the same for
    every example, so the table's gradient is a sum over the batch, like a bias's. It is
    summed in float32 under reduce_dtype=f32 (it was a bfloat16 sum: >1e-3 off)."""
    def layer(p, x):
        return x + jnp.take(p["positions"], jnp.arange(x.shape[1]), axis=0)[None]

    k = jax.random.split(jax.random.PRNGKey(5), 3)
    p = {"positions": jax.random.normal(k[0], (40, 24))}
    x = jax.random.normal(k[1], (64, 40, 24))
    g = jax.random.normal(k[2], (64, 40, 24)).astype(jnp.bfloat16).astype(jnp.float32)
    exact = np.asarray(g, np.float64).sum(0)
    got = {r: jax.vjp(lambda q: precision.autocast(layer, "mixed_bf16", reduce_dtype=r)(q, x), p)[1](g)[0]["positions"]
           for r in (None, "f32")}
    error = {r: float(np.max(np.abs(np.asarray(v, np.float64) - exact)) / np.abs(exact).max()) for r, v in got.items()}
    assert got["f32"].dtype == F32 and error["f32"] < 1e-5 and error[None] > 1e-3, error
    out = precision.autocast(layer, "mixed_bf16", reduce_dtype="f32")(p, x)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(precision.autocast(layer, "mixed_bf16")(p, x)))


def test_reduce_dtype_needs_autocast_and_the_optimizers_own_loss_scale_counts():
    with pytest.raises(ValueError, match="reduce_dtype=bfloat16 needs autocast=True"):
        precision.with_policy(_TokenNet(), "mixed_bf16", reduce_dtype="bf16", autocast=False)
    mesh = Layout(make_mesh(1, 1, jax.devices()[:1]))
    plain = create_train_state(_TokenNet(), "mixed_bf16", optax.sgd(0.1), jax.random.PRNGKey(0), IDS[:1],
                               autocast=False, layout=mesh)
    assert plain.model.reduce_dtype is None and not plain.model.autocast
    with pytest.raises(ValueError, match="needs autocast=True"):
        create_train_state(_TokenNet(), "mixed_bf16", optax.sgd(0.1), jax.random.PRNGKey(0), IDS[:1],
                           autocast=False, reduce_dtype="f32")
    # A pre-wrapped optimizer's loss scale is the one checked: a dynamic one allows f16.
    tx = precision.mixed_precision(optax.sgd(0.1), precision.DynamicLossScale(2.0 ** 15))
    state = create_train_state(_TokenNet(), "mixed_bf16", tx, jax.random.PRNGKey(0), IDS[:1], reduce_dtype="f16")
    assert state.model.reduce_dtype == np.dtype(np.float16)


@pytest.mark.parametrize("remat", ["none", "full"])
def test_scanned_and_rematerialised_layers_get_their_weight_gradients_in_the_reduce_dtype(remat):
    """The project's GPT with its blocks in one lax.scan (stacked params sliced per layer),
    rematerialised or not: the weight-gradient products inside the scan body are float32
    products, its forward matmuls still bfloat16."""
    from train.models import GPT

    model = GPT(vocab_size=32, block_size=16, num_layers=2, num_heads=2, d_model=32, scan_layers=True, remat=remat)
    ids = jnp.zeros((4, 16), jnp.int32)
    params = model.init(jax.random.PRNGKey(0), ids)["params"]
    wrapped = precision.with_policy(model, "mixed_bf16", reduce_dtype="f32")
    jaxpr = jax.make_jaxpr(jax.grad(lambda p: jnp.mean(wrapped.apply({"params": p}, ids).astype(jnp.float32) ** 2)))(
        params)
    kernels = {s for x in jax.tree_util.tree_leaves(params["blocks"]) if x.ndim == 3
               for s in (tuple(x.shape[1:]), tuple(x.shape[1:])[::-1])}
    dots = [op for op in iter_ops(jaxpr.jaxpr) if op.primitive == "dot_general"]
    weight = [op for op in dots if tuple(op.eqn.outvars[0].aval.shape) in kernels]
    assert len(weight) >= 4 and all(op.out_dtypes == (F32,) for op in weight)
    assert any(op.out_dtypes == (BF16,) and not op.backward for op in dots)
