"""Layer and RMS norms a model writes out, differentiated in closed form
(``precision.autocast.norm_fusion``): found in the ways people write them, the forward
unchanged to the bit, the gradients those of the op-by-op backward up to rounding, and
left alone where the closed form would not be the same computation. The H100 program's
kernel count is checked in test_step_cost."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from hypothesis import given, settings, strategies as st

import precision
from precision.autocast.norm_pattern import describe, find_norms

X = jax.random.normal(jax.random.key(1), (4, 16, 32)) * 3 + 1


def _llama_rms(x, w):
    variance = jnp.mean(jnp.square(x.astype(jnp.float32)), axis=-1, keepdims=True)
    return (x * jax.lax.rsqrt(variance + 1e-6)) * w


def _two_pass(x, g, b):
    m = x.mean(-1, keepdims=True)
    v = ((x - m) ** 2).mean(-1, keepdims=True)
    return (x - m) * jax.lax.rsqrt(v + 1e-5) * g + b


def _gemma_rms(x, w):
    return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * (1 + w)


def _stats_read_outside(x, g, b):  # its statistics leave it too (as a BatchNorm's running averages do)
    m = x.mean(-1, keepdims=True)
    v = ((x - m) ** 2).mean(-1, keepdims=True)
    return (x - m) * jax.lax.rsqrt(v + 1e-5) * g + b + m * jnp.sin(v)


def _centred_once(x, g, b):  # a hand-written layer norm naming its centred values once, for both uses
    c = x - x.mean(-1, keepdims=True)
    return c * jax.lax.rsqrt((c ** 2).mean(-1, keepdims=True) + 1e-5) * g + b


def _centred_read_outside(x, g, b):  # its centred values leave it: not the same computation
    c = x - x.mean(-1, keepdims=True)
    return c * jax.lax.rsqrt((c ** 2).mean(-1, keepdims=True) + 1e-5) * g + b + c


def _scale_from_x(x, g):  # a "scale" computed from x stays outside: the norm is x * rstd alone
    v = jnp.mean(x * x, -1, keepdims=True)
    return x * jax.lax.rsqrt(v + 1e-6) * (g * x.mean())


def _found(fn, *args):
    closed = jax.make_jaxpr(fn)(*args)
    return [describe(n) for n in find_norms(closed.jaxpr, dict(zip(closed.jaxpr.constvars, closed.consts)))]


def _linen(module):
    variables = module.init(jax.random.key(0), X)
    mutable = ["batch_stats"] if "batch_stats" in variables else False
    return lambda x: module.apply(variables, x, mutable=mutable)


def _nnx_training(module):
    graphdef, state = nnx.split(module)

    def run(state, x):
        model = nnx.merge(graphdef, state)
        return model(x), nnx.state(model)
    return run, state


_NNX_BATCH_NORM, _NNX_BATCH_STATS = _nnx_training(nnx.BatchNorm(32, use_running_average=False, rngs=nnx.Rngs(0)))
W = jnp.linspace(0.5, 1.5, 32)


@pytest.mark.parametrize("fn,args,expected", [
    (_linen(nn.LayerNorm()), (X,), "layer norm over axis -1 with scale and offset"),
    (_linen(nn.LayerNorm(use_fast_variance=False)), (X,), "layer norm over axis -1 with scale and offset"),
    (_linen(nn.LayerNorm(use_bias=False)), (X,), "layer norm over axis -1 with scale"),
    (_linen(nn.LayerNorm(use_scale=False, use_bias=False)), (X,), "layer norm over axis -1"),
    (_linen(nn.LayerNorm(reduction_axes=(-2, -1), feature_axes=-1)), (X,),
     "layer norm over axis -2, -1 with scale and offset"),
    (_linen(nn.RMSNorm()), (X,), "RMS norm over axis -1 with scale"),
    (nnx.LayerNorm(32, rngs=nnx.Rngs(0)), (X,), "layer norm over axis -1 with scale and offset"),
    (nnx.RMSNorm(32, rngs=nnx.Rngs(0)), (X,), "RMS norm over axis -1 with scale"),
    (_llama_rms, (X, W), "RMS norm over axis -1 with scale"),
    (_two_pass, (X, W, W), "layer norm over axis -1 with scale and offset"),
    (_centred_once, (X, W, W), "layer norm over axis -1 with scale and offset"),
    (_gemma_rms, (X, W), "RMS norm over axis -1 with scale"),
    (_scale_from_x, (X, W), "RMS norm over axis -1"),
    (_stats_read_outside, (X, W, W), "layer norm over axis -1 with scale and offset"),
    (_linen(nn.BatchNorm(use_running_average=False)), (X,), "batch norm over axis -3, -2 with scale and offset"),
    (_NNX_BATCH_NORM, (_NNX_BATCH_STATS, X), "batch norm over axis -3, -2 with scale and offset"),
])
def test_norms_are_found_as_people_write_them(fn, args, expected):
    assert _found(fn, *args) == [expected]


@pytest.mark.parametrize("fn,args", [(_centred_read_outside, (X, W, W)),
                                     (_linen(nn.BatchNorm(use_running_average=True)), (X,)),
                                     (lambda x: jax.nn.softmax(x), (X,))])
def test_what_is_not_the_same_computation_is_left_alone(fn, args):
    if isinstance(fn, nn.Module):
        fn = _linen(fn)
    assert _found(fn, *args) == []


class Block(nn.Module):
    """Three norms of three kinds between layers, as a transformer block writes them."""

    @nn.compact
    def __call__(self, x):
        x = x + nn.Dense(32)(nn.LayerNorm()(x))
        x = x + nn.Dense(32)(nn.RMSNorm()(x))
        return nn.Dense(8)(nn.LayerNorm(use_fast_variance=False, use_bias=False)(x))


class NNXBlock(nnx.Module):
    def __init__(self, rngs):
        self.norm = nnx.RMSNorm(32, rngs=rngs)
        self.dense = nnx.Linear(32, 8, rngs=rngs)

    def __call__(self, x):
        return self.dense(_llama_rms(self.norm(x), 1.0 + jnp.zeros(32)))


def _outputs_and_grads(model, policy, fuse, params=None):
    wrapped = precision.with_policy(model, policy, ops=precision.op_lists(fuse_norms=fuse))
    variables = wrapped.init(jax.random.key(0), X)

    def loss(p, x):
        return jnp.sum(jnp.sin(wrapped.apply({"params": p}, x).astype(jnp.float32)))

    out = wrapped.apply(variables, X)
    return out, jax.grad(loss, argnums=(0, 1))(variables["params"], X), jax.make_jaxpr(loss)(variables["params"], X)


def _fused(program) -> int:
    """How many norms a traced program makes with their own derivative rule."""
    text = str(program)
    return text.count("custom_jvp_call") + text.count("custom_vjp_call")


def _max_rel(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


@pytest.mark.parametrize("policy,tol", [("params=f32,compute=f32", 2e-6), ("mixed_bf16", 8e-3), ("mixed_f16", 1e-3)])
def test_the_forward_is_unchanged_and_the_gradients_are_the_op_by_op_ones(policy, tol):
    out, grads, program = _outputs_and_grads(Block(), policy, True)
    out_off, grads_off, program_off = _outputs_and_grads(Block(), policy, False)
    assert out.dtype == out_off.dtype
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(out_off, np.float32))
    assert _fused(program) - _fused(program_off) == 3
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree_util.tree_leaves(grads_off)):
        assert a.dtype == b.dtype, path
        assert _max_rel(a, b) <= tol, (jax.tree_util.keystr(path), _max_rel(a, b))


class PinnedBlock(nn.Module):
    """Layers that pin their dtypes, as a careful user writes them (float32 norms, bfloat16 matmuls)."""

    @nn.compact
    def __call__(self, x):
        h = nn.LayerNorm(dtype=jnp.float32, param_dtype=jnp.float32)(x)
        x = x + nn.Dense(32, dtype=jnp.bfloat16)(h).astype(jnp.float32)
        return nn.Dense(8, dtype=jnp.float32)(nn.RMSNorm(dtype=jnp.float32)(x))


def test_pinned_dtypes_and_numpy_inputs_keep_half_matmuls_and_float32_norms():
    """Under mixed_bf16 the pinned model's matmuls still run in bfloat16, its norms in float32,
    fused, with the op-by-op gradients; numpy inputs as well as jax arrays."""
    images = np.asarray(X)
    model = precision.with_policy(PinnedBlock(), "mixed_bf16")
    off = precision.with_policy(PinnedBlock(), "mixed_bf16", ops=precision.op_lists(fuse_norms=False))
    params = model.init(jax.random.key(0), images)["params"]

    def loss(m, p):
        return jnp.sum(jnp.sin(m.apply({"params": p}, images).astype(jnp.float32)))

    program = jax.make_jaxpr(lambda p: loss(model, p))(params)
    assert _fused(program) - _fused(jax.make_jaxpr(lambda p: loss(off, p))(params)) == 2
    dots = [e for e in program.jaxpr.eqns if e.primitive.name == "dot_general"]
    assert dots and all(v.aval.dtype == jnp.bfloat16 for e in dots for v in e.invars)
    norms = [e for e in jax.make_jaxpr(lambda p: model.apply({"params": p}, images))(params).eqns
             if "custom" in e.primitive.name]
    assert len(norms) == 2 and all(v.aval.dtype == jnp.float32 for e in norms for v in e.outvars)
    for a, b in zip(jax.tree_util.tree_leaves(jax.grad(lambda p: loss(model, p))(params)),
                    jax.tree_util.tree_leaves(jax.grad(lambda p: loss(off, p))(params))):
        assert _max_rel(a, b) <= 8e-3


def test_forward_mode_and_hessian_vector_products_work_through_layer_and_rms_norms():
    model = precision.with_policy(Block(), "params=f32,compute=f32")
    off = precision.with_policy(Block(), "params=f32,compute=f32", ops=precision.op_lists(fuse_norms=False))
    params = model.init(jax.random.key(0), X)["params"]
    direction = jax.tree_util.tree_map(jnp.ones_like, params)

    def loss(m, p):
        return jnp.sum(jnp.sin(m.apply({"params": p}, X)))

    for fn in (lambda m: jax.jvp(lambda p: loss(m, p), (params,), (direction,))[1],
               lambda m: jax.jvp(jax.grad(lambda p: loss(m, p)), (params,), (direction,))[1]):
        for a, b in zip(jax.tree_util.tree_leaves(fn(model)), jax.tree_util.tree_leaves(fn(off))):
            assert _max_rel(a, b) <= 1e-5


def test_norms_inside_scan_and_remat_are_fused_too():
    class Layer(nn.Module):
        @nn.compact
        def __call__(self, x, _):
            return x + nn.Dense(32)(nn.LayerNorm()(x)), None

    class Stack(nn.Module):
        @nn.compact
        def __call__(self, x):
            scanned = nn.scan(nn.remat(Layer), variable_axes={"params": 0}, split_rngs={"params": True}, length=3)
            return scanned()(x, None)[0]

    out, grads, program = _outputs_and_grads(Stack(), "mixed_bf16", True)
    out_off, grads_off, _ = _outputs_and_grads(Stack(), "mixed_bf16", False)
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(out_off, np.float32))
    assert _fused(program)
    for a, b in zip(jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(grads_off)):
        assert _max_rel(a, b) <= 2e-6


def test_nnx_models_and_o2_params_get_gradients_in_their_own_dtype():
    model = NNXBlock(nnx.Rngs(0))
    graphdef, params = nnx.split(model)

    def loss(p, fuse):
        m = nnx.merge(graphdef, p)
        f = precision.autocast(lambda x: m(x), "params=bf16,compute=bf16",
                               ops=precision.op_lists(fuse_norms=fuse))
        return jnp.sum(f(X).astype(jnp.float32) ** 2)

    half = jax.tree_util.tree_map(lambda a: a.astype(jnp.bfloat16), params)
    on, off = jax.grad(loss)(half, True), jax.grad(loss)(half, False)
    for a, b in zip(jax.tree_util.tree_leaves(on), jax.tree_util.tree_leaves(off)):
        assert a.dtype == b.dtype == jnp.bfloat16
        assert _max_rel(a, b) <= 2e-2  # bfloat16 gradients: a rounding apart
    assert _fused(jax.make_jaxpr(loss, static_argnums=1)(half, True))


def test_a_model_trains_to_the_same_loss():
    """Thirty Adam steps of the block under mixed_bf16, with and without: the same losses."""
    y = jnp.sin(X[..., :8])
    losses = {}
    for fuse in (True, False):
        model = precision.with_policy(Block(), "mixed_bf16", ops=precision.op_lists(fuse_norms=fuse))
        params = model.init(jax.random.key(0), X)["params"]
        tx = optax.adam(1e-2)
        opt = tx.init(params)

        @jax.jit
        def step(params, opt):
            loss, g = jax.value_and_grad(
                lambda p: jnp.mean((model.apply({"params": p}, X).astype(jnp.float32) - y) ** 2))(params)
            updates, opt = tx.update(g, opt, params)
            return optax.apply_updates(params, updates), opt, loss

        history = []
        for _ in range(30):
            params, opt, loss = step(params, opt)
            history.append(float(loss))
        losses[fuse] = history
    assert losses[True][-1] < 0.5 * losses[True][0]
    np.testing.assert_allclose(losses[True], losses[False], rtol=2e-2)


class ConvNet(nn.Module):
    """A ResNet's stem: convolution, BatchNorm in training (its running averages updated), ReLU."""

    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.BatchNorm(use_running_average=False)(nn.Conv(8, (3, 3))(x)))
        return nn.Dense(3)(nn.BatchNorm(use_running_average=False, use_bias=False)(x).mean((1, 2)))


IMAGES = jax.random.normal(jax.random.key(2), (4, 6, 6, 3)) * 2 + 1


@pytest.mark.parametrize("policy", ["params=f32,compute=f32", "mixed_bf16"])
def test_batch_norm_in_training_keeps_its_running_averages_and_gets_the_op_by_op_gradients(policy):
    results = {}
    for fuse in (True, False):
        model = precision.with_policy(ConvNet(), policy, ops=precision.op_lists(fuse_norms=fuse))
        variables = model.init(jax.random.key(0), IMAGES)

        def loss(p):
            out, state = model.apply({"params": p, "batch_stats": variables["batch_stats"]}, IMAGES,
                                     mutable=["batch_stats"])
            return jnp.sum(jnp.sin(out.astype(jnp.float32))), state

        (value, state), grads = jax.value_and_grad(loss, has_aux=True)(variables["params"])
        results[fuse] = value, state, grads, _fused(jax.make_jaxpr(loss)(variables["params"]))
    (value, state, grads, calls), (value_off, state_off, grads_off, calls_off) = results[True], results[False]
    assert calls - calls_off == 2  # (ReLU is a custom_jvp of its own)
    assert value == value_off
    chex_equal = jax.tree_util.tree_map(lambda a, b: bool(jnp.all(a == b)), state, state_off)
    assert all(jax.tree_util.tree_leaves(chex_equal))  # the running averages, to the bit
    largest = max(float(jnp.max(jnp.abs(g))) for g in jax.tree_util.tree_leaves(grads_off))
    for a, b in zip(jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(grads_off)):
        assert float(jnp.max(jnp.abs(a - b))) <= 1e-5 * largest


def test_gradients_through_the_statistics_given_out_are_counted():
    """A loss that reads a norm's statistics too (its running averages differentiated)."""
    module = nn.BatchNorm(use_running_average=False)
    variables = module.init(jax.random.key(0), IMAGES)

    def loss(x, fuse):
        run = precision.autocast(lambda x: module.apply(variables, x, mutable=["batch_stats"]),
                                 "params=f32,compute=f32", ops=precision.op_lists(fuse_norms=fuse))
        out, state = run(x)
        stats = state["batch_stats"]
        return jnp.sum(jnp.sin(out)) + 10 * jnp.sum(jnp.cos(stats["mean"])) + 10 * jnp.sum(stats["var"] ** 2)

    assert _max_rel(jax.grad(loss)(IMAGES, True), jax.grad(loss)(IMAGES, False)) <= 1e-5


def test_a_layer_norms_statistics_read_outside_get_their_gradient_in_both_modes():
    def loss(fuse, x, g, b):
        f = precision.autocast(_stats_read_outside, "params=f32,compute=f32", ops=precision.op_lists(fuse_norms=fuse))
        return jnp.sum(jnp.cos(f(x, g, b)))

    for fn in (lambda fuse: jax.grad(loss, argnums=1)(fuse, X, W, W),
               lambda fuse: jax.jvp(lambda x: loss(fuse, x, W, W), (X,), (jnp.cos(X),))[1]):
        assert _max_rel(fn(True), fn(False)) <= 1e-5


def test_a_norm_reading_its_centred_values_once_gets_the_op_by_op_gradients():
    def loss(fuse, x, g, b):
        f = precision.autocast(_centred_once, "params=f32,compute=f32", ops=precision.op_lists(fuse_norms=fuse))
        return jnp.sum(jnp.cos(f(x, g, b)))

    grads = {fuse: jax.grad(loss, argnums=(1, 2, 3))(fuse, X, W, W) for fuse in (True, False)}
    for a, b in zip(grads[True], grads[False]):
        assert _max_rel(a, b) <= 1e-5
    assert _fused(jax.make_jaxpr(lambda x: loss(True, x, W, W))(X)) == 1


class _Mixed(nn.Module):
    """Flax's norms, one written out whose centred values leave it (left as written), under rules."""

    @nn.compact
    def __call__(self, x):
        x = nn.Dense(32)(nn.LayerNorm()(x)) + nn.RMSNorm()(x)
        return nn.Dense(8)(_centred_read_outside(x, W, W))


def test_explain_lists_each_norm_differentiated_in_closed_form_and_why_others_are_left_as_written():
    lines = str(precision.explain(_Mixed(), X, policy="mixed_bf16")).splitlines()
    start = lines.index("norms: 2 of 3 differentiated in closed form")
    assert lines[start + 1:start + 4] == [
        "  LayerNorm_0: layer norm over axis -1 with scale and offset",
        "  RMSNorm_0: RMS norm over axis -1 with scale",
        "  (top): left as written: its centred or normalized values are read outside it"], lines
    off = precision.explain(_Mixed(), X, policy="mixed_bf16", ops=precision.op_lists(fuse_norms=False))
    assert off.closed_form_norms == () and off.norms[0] == (
        "LayerNorm_0", "layer norm over axis -1 with scale and offset, left as written: closed-form norms are "
                       "off (fuse_norms=False)")
    reduced = precision.explain(precision.with_policy(_Mixed(), "mixed_bf16", reduce_dtype="bf16"), X)
    assert reduced.closed_form_norms == () and "gradients are reduced in bfloat16" in reduced.norms[1][1]
    assert not any("norm" in island.reason for island in reduced.islands)  # the reports are not islands


def test_fuse_norms_false_in_a_config_leaves_them_op_by_op():
    from train.config.schema import PrecisionConfig, build_op_lists

    assert build_op_lists(PrecisionConfig(fuse_norms=False)).fuse_norms is False
    assert build_op_lists(PrecisionConfig()) is None  # the defaults: fused


@settings(max_examples=12, deadline=None, derandomize=True)
@given(shape=st.sampled_from([(3, 5), (2, 3, 8), (2, 4, 3, 6)]), last_axes=st.integers(1, 2),
       centred=st.booleans(), two_pass=st.booleans(), scale=st.booleans(), offset=st.booleans(),
       eps=st.sampled_from([1e-6, 1e-3, 0.5]))
def test_the_closed_form_is_the_derivative_for_any_axes_and_operands(shape, last_axes, centred, two_pass, scale,
                                                                    offset, eps):
    axes = tuple(range(len(shape) - min(last_axes, len(shape) - 1), len(shape)))
    feature = tuple(shape[a] for a in axes)
    rng = np.random.default_rng(sum(shape) + len(axes))
    x = jnp.asarray(rng.normal(1.0, 2.0, shape), jnp.float32)
    g, b = (jnp.asarray(rng.normal(1.0, 0.3, feature), jnp.float32) for _ in range(2))

    def norm(x, g, b):
        mean = x.mean(axes, keepdims=True) if centred else 0.0
        var = ((x - mean) ** 2).mean(axes, keepdims=True) if two_pass or not centred else \
            jnp.maximum((x * x).mean(axes, keepdims=True) - mean ** 2, 0.0)
        y = (x - mean) * jax.lax.rsqrt(var + eps) if centred else x * jax.lax.rsqrt(var + eps)
        return y * (g if scale else 1.0) + (b if offset else 0.0)

    def loss(fuse, x, g, b):
        f = precision.autocast(norm, "params=f32,compute=f32", ops=precision.op_lists(fuse_norms=fuse))
        return jnp.sum(jnp.cos(f(x, g, b)) * jnp.arange(x.size).reshape(x.shape) / x.size)

    grads = jax.grad(loss, argnums=(1, 2, 3))
    assert _fused(jax.make_jaxpr(loss, static_argnums=0)(True, x, g, b))
    for a, e in zip(grads(True, x, g, b), grads(False, x, g, b)):
        np.testing.assert_allclose(a, e, rtol=2e-5, atol=2e-5 * float(jnp.max(jnp.abs(e))))
