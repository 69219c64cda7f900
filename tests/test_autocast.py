"""A policy reaches every matmul of models written the usual way (pinned
``dtype=`` attributes), keeps the numerically sensitive ops in float32, and
says what it did (``precision.explain``).

The half-precision share is checked twice: by ``explain`` and, independently,
by reading the lowered HLO of the differentiated step.
"""

import warnings

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import precision
import train
from benchmarks import hlo
from benchmarks.measure import saved_residuals
from precision.explain import AUTOCAST_OFF, NOT_REACHED, RULE
from precision.program import iter_ops
from tests.user_models import (LMConfig, PinnedLM, PinnedNNXMLP, PinnedResNet, ScannedLM, clipped_matmul,
                               plain_mlp)

HALF_POLICIES = ("mixed_bf16", "mixed_f16", "O1")
TOKENS = jax.random.randint(jax.random.key(1), (2, 8), 0, 32)
IMAGES = jax.random.normal(jax.random.key(2), (2, 8, 8, 3))
LINEN = {
    "lm": (PinnedLM(), TOKENS, {"train": False}),
    "resnet": (PinnedResNet(), IMAGES, {"train": False}),
    "scanned": (ScannedLM(), TOKENS, {}),
}


def _loss(out):
    """A loss whose gradient reaches every output (and is not all ones)."""
    out = out.astype(jnp.float32)
    return jnp.mean(jax.nn.log_softmax(out) * jnp.cos(jnp.arange(out.shape[-1], dtype=jnp.float32)))


def linen_grad_fn(model, policy, x, kwargs, rules=None):
    """``(params, grad_fn)``: the loss gradient of a Linen model under ``policy``."""
    wrapped = precision.with_policy(model, policy, rules)
    variables = wrapped.init(jax.random.key(0), x, **kwargs)

    def loss(params):
        return _loss(wrapped.apply({**variables, "params": params}, x, **kwargs))

    return variables["params"], jax.grad(loss)


def lowered_share(fn, *args):
    """Half share of matmul/conv FLOPs in the lowered HLO of ``jit(fn)``."""
    return hlo.matmul_flops(jax.jit(fn).lower(*args).as_text(dialect="hlo")).half_share


def input_dtypes(fn, *args, primitives):
    """{primitive: set of floating input dtype names} over the traced program."""
    found = {}
    for op in iter_ops(jax.make_jaxpr(fn)(*args)):
        if op.primitive in primitives:
            found.setdefault(op.primitive, set()).update(
                d.name for d in op.in_dtypes if jnp.issubdtype(d, jnp.floating))
    return found


def relative_error(a, b):
    a, b = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    num = sum(float(jnp.sum((x.astype(jnp.float32) - y) ** 2)) for x, y in zip(a, b))
    return (num / sum(float(jnp.sum(y ** 2)) for y in b)) ** 0.5


@pytest.mark.parametrize("policy", HALF_POLICIES)
@pytest.mark.parametrize("name", sorted(LINEN))
def test_pinned_linen_models_run_half_forward_and_backward(name, policy):
    model, x, kwargs = LINEN[name]
    expl = precision.explain(model, x, policy=policy, **kwargs)
    assert expl.forward[0] / expl.forward[1] >= 0.95, expl
    assert expl.backward[0] / expl.backward[1] >= 0.95, expl
    assert expl.uncovered_share <= 0.05
    params, grad_fn = linen_grad_fn(model, policy, x, kwargs)
    assert lowered_share(grad_fn, params) >= 0.95
    grads = jax.eval_shape(grad_fn, params)
    assert all(g.dtype == jnp.float32 for g in jax.tree_util.tree_leaves(grads))
    assert all(p.dtype == jnp.float32 for p in jax.tree_util.tree_leaves(params))


@pytest.mark.parametrize("name", sorted(LINEN))
def test_fp32_policy_runs_nothing_in_half(name):
    model, x, kwargs = LINEN[name]
    expl = precision.explain(model, x, policy="fp32", **kwargs)
    assert expl.half_share == 0.0 and expl.uncovered_share == 0.0
    params, grad_fn = linen_grad_fn(model, "fp32", x, kwargs)
    assert lowered_share(grad_fn, params) == 0.0


def test_explain_agrees_with_lowered_program():
    for policy, rules in (("mixed_bf16", None), ("mixed_f16", [("block_1", "f32")])):
        model, x, kwargs = LINEN["lm"]
        expl = precision.explain(model, x, policy=policy, rules=rules, **kwargs)
        params, grad_fn = linen_grad_fn(model, policy, x, kwargs, rules)
        assert expl.half_share == pytest.approx(lowered_share(grad_fn, params), abs=0.01)


@pytest.mark.parametrize("policy,tolerance", [("mixed_bf16", 0.05), ("mixed_f16", 0.01)])
def test_sensitive_ops_stay_float32_and_gradients_match_fp32(policy, tolerance):
    model, x, kwargs = LINEN["lm"]
    params, grad_fn = linen_grad_fn(model, policy, x, kwargs)
    half = jnp.dtype(precision.get_policy(policy).compute_dtype).name
    found = input_dtypes(grad_fn, params, primitives=("dot_general", "exp", "log", "rsqrt", "erf"))
    assert found["dot_general"] == {half}
    for sensitive in ("exp", "log", "rsqrt"):  # softmax, log-softmax, norms' statistics
        assert found[sensitive] == {"float32"}, (sensitive, found[sensitive])
    _, fp32_grad_fn = linen_grad_fn(model, "fp32", x, kwargs)
    assert relative_error(jax.jit(grad_fn)(params), jax.jit(fp32_grad_fn)(params)) < tolerance


def test_norm_statistics_in_float32_inside_pinned_resnet():
    model, x, _ = LINEN["resnet"]
    wrapped = precision.with_policy(model, "mixed_f16")
    variables = wrapped.init(jax.random.key(0), x, train=False)

    def loss(params):
        out, _ = wrapped.apply({**variables, "params": params}, x, train=True, mutable=["batch_stats"])
        return _loss(out)

    found = input_dtypes(jax.grad(loss), variables["params"],
                         primitives=("conv_general_dilated", "rsqrt", "reduce_sum"))
    assert found["conv_general_dilated"] == {"float16"}
    assert found["rsqrt"] == {"float32"}
    _, state = wrapped.apply(variables, x, train=True, mutable=["batch_stats"])
    assert all(s.dtype == jnp.float32 for s in jax.tree_util.tree_leaves(state))


def test_rule_wins_inside_autocast():
    model, x, kwargs = LINEN["lm"]
    expl = precision.explain(model, x, policy="mixed_bf16", rules=[("head", "f32")], **kwargs)
    head = {m.path: m for m in expl.modules}["head"]
    assert head.half_flops == 0 and head.total_flops > 0
    assert head.f32_reason == RULE
    assert "head" not in expl.uncovered
    others = [m for m in expl.modules if m.path != "head" and m.total_flops]
    assert all(m.half_share == 1.0 for m in others), expl


def test_train_state_and_step_reach_pinned_model():
    model, x, _ = LINEN["lm"]
    batch = {"inputs": x, "labels": jnp.roll(x, -1, axis=1)}
    shares, losses = {}, {}
    for policy in ("fp32", "mixed_bf16"):
        state = train.create_train_state(model, policy, optax.adam(3e-3), jax.random.key(0), x)
        assert all(p.dtype == jnp.float32 for p in jax.tree_util.tree_leaves(state.params))
        step = train.make_train_step(donate=False)
        shares[policy] = hlo.matmul_flops(step.lower(state, batch).as_text(dialect="hlo")).half_share
        for _ in range(25):
            state, metrics = step(state, batch)
        losses[policy] = float(metrics["loss"])
    assert shares == {"fp32": 0.0, "mixed_bf16": pytest.approx(1.0, abs=0.05)}
    assert losses["mixed_bf16"] == pytest.approx(losses["fp32"], rel=0.05)
    assert losses["fp32"] < 0.7 * np.log(32)


@pytest.mark.parametrize("policy", HALF_POLICIES + ("fp32",))
def test_pinned_nnx_model(policy):
    model = precision.with_policy(PinnedNNXMLP(6, 16, 4, rngs=nnx.Rngs(0)), policy)
    x = jax.random.normal(jax.random.key(3), (4, 6))
    expl = precision.explain(model, x)
    assert expl.half_share == (0.0 if policy == "fp32" else 1.0), expl

    def loss(m, x):
        return _loss(m(x))

    grads = nnx.grad(loss)(model, x)
    assert all(g.dtype == jnp.float32 for g in jax.tree_util.tree_leaves(nnx.state(grads, nnx.Param)))
    stored = jnp.dtype(precision.get_policy(policy).param_dtype)
    assert all(p.dtype == stored for p in jax.tree_util.tree_leaves(nnx.state(model, nnx.Param)))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def grads_of(params, rest, x):
        return nnx.grad(loss)(nnx.merge(graphdef, params, rest), x)

    share = lowered_share(grads_of, params, rest, x)
    assert share == (0.0 if policy == "fp32" else 1.0)


def test_plain_function_with_custom_vjp():
    params = {"w1": jax.random.normal(jax.random.key(4), (6, 16)) / 3, "b1": jnp.zeros(16),
              "w2": jax.random.normal(jax.random.key(5), (16, 4)) / 4}
    x = jax.random.normal(jax.random.key(6), (8, 6))
    fn = precision.autocast(plain_mlp, "mixed_bf16")
    out = fn(params, x)
    assert out.dtype == jnp.float32  # the types the function was written for
    chex.assert_trees_all_close(out, plain_mlp(params, x), atol=0.05)
    loss = lambda f: lambda p: jnp.sum(f(p, x)[:, 0])  # noqa: E731
    found = input_dtypes(jax.grad(loss(fn)), params, primitives=("dot_general", "exp", "log"))
    assert found["dot_general"] == {"bfloat16"}  # custom_vjp forward and backward included
    assert found["exp"] == {"float32"} and found["log"] == {"float32"}
    grads = jax.jit(jax.grad(loss(fn)))(params)
    assert relative_error(grads, jax.grad(loss(plain_mlp))(params)) < 0.05
    assert precision.explain(plain_mlp, params, x, policy="mixed_bf16").half_share == 1.0


def test_custom_vjp_backward_rule_still_applies():
    x = jnp.ones((2, 3))
    w = jnp.ones((3, 2))
    g = jax.grad(lambda w: jnp.sum(precision.autocast(clipped_matmul, "mixed_f16")(x, w) * 5.0))(w)
    np.testing.assert_allclose(g, jnp.full((3, 2), 2.0))  # clipped to 1 per output, times 2 rows


def test_control_flow_jit_and_shard_map():
    mesh = jax.make_mesh((1,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))

    def fn(w, x):
        def body(h, _):
            h = jax.lax.cond(jnp.sum(h) > 0, lambda h: jnp.tanh(h @ w), lambda h: jax.nn.relu(h @ w), h)
            return h, jnp.max(h)

        h, peaks = jax.lax.scan(jax.checkpoint(body), x, None, length=3)
        h = jax.lax.fori_loop(0, 2, lambda i, h: jax.jit(jnp.dot)(h, w), h)
        sharded = jax.shard_map(lambda h: h @ w, mesh=mesh, in_specs=jax.P("data"), out_specs=jax.P("data"))
        return jnp.sum(sharded(h) ** 2) + jnp.sum(peaks)

    w = jax.random.normal(jax.random.key(7), (4, 4)) / 2
    x = jax.random.normal(jax.random.key(8), (2, 4))
    auto = precision.autocast(fn, "mixed_bf16")
    found = input_dtypes(jax.grad(auto), w, x, primitives=("dot_general",))
    assert found["dot_general"] == {"bfloat16"}
    assert relative_error(jax.jit(jax.grad(auto))(w, x), jax.grad(fn)(w, x)) < 0.05


def test_residuals_saved_for_backward_are_half():
    """Activations kept for the backward pass take the memory of the half
    model: as little as the same model written in bfloat16 by hand."""
    model, _, kwargs = LINEN["lm"]
    x = jax.random.randint(jax.random.key(1), (32, 8), 0, 32)  # activations outweigh weight copies
    params, _ = linen_grad_fn(model, "fp32", x, kwargs)

    def saved_bytes(fn):
        return sum(nbytes for dtype, _, nbytes, source in saved_residuals(fn, params)
                   if dtype.startswith(("f", "bf")) and not source.startswith("from the argument"))

    wrapped = precision.with_policy(model, "mixed_bf16")
    auto = saved_bytes(lambda p: _loss(wrapped.apply({"params": p}, x, **kwargs)))
    by_hand = PinnedLM(LMConfig(dtype=jnp.bfloat16))
    hand = saved_bytes(lambda p: _loss(by_hand.apply({"params": p}, x, **kwargs)))
    full = saved_bytes(lambda p: _loss(model.apply({"params": p}, x, **kwargs)))
    assert auto <= 1.1 * hand
    assert auto < 0.75 * full


def test_warns_when_policy_cannot_reach_the_model():
    model, x, kwargs = LINEN["lm"]
    off = precision.with_policy(model, "mixed_bf16", autocast=False)  # pinned dtypes win
    expl = precision.explain(off, x, **kwargs)
    assert expl.half_share < 0.05
    assert "block_0" in str(expl) and AUTOCAST_OFF in str(expl)
    with pytest.warns(precision.PrecisionWarning, match="block_0"):
        precision.check_coverage(expl)
    with pytest.raises(precision.CoverageError, match="in float32"):
        precision.check_coverage(expl, strict=True)
    with pytest.warns(precision.PrecisionWarning, match="of PinnedLM"):
        train.create_train_state(off, None, optax.sgd(0.1), jax.random.key(0), x)
    with pytest.raises(precision.CoverageError):
        train.create_train_state(off, None, optax.sgd(0.1), jax.random.key(0), x, strict=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", precision.PrecisionWarning)
        train.create_train_state(model, "mixed_bf16", optax.sgd(0.1), jax.random.key(0), x)


def test_warns_for_an_opaque_primitive():
    @jax.custom_batching.custom_vmap
    def opaque(x, w):
        return jnp.tanh(x @ w)

    opaque.def_vmap(lambda size, batched, x, w: (jnp.tanh(x @ w), True))
    expl = precision.explain(lambda w, x: jnp.sum(opaque(x, w) @ w), jnp.ones((8, 8)), jnp.ones((4, 8)),
                             policy="mixed_bf16", backward=False)
    assert expl.half_share == pytest.approx(0.5)
    assert NOT_REACHED in str(expl) and "custom_vmap_call" in str(expl)
    with pytest.warns(precision.PrecisionWarning):
        precision.check_coverage(expl)


def test_op_lists_extend_and_shrink():
    w = jax.random.normal(jax.random.key(9), (4, 4))
    fn = lambda w: jnp.sum(jnp.exp(jnp.tanh(w @ w)))  # noqa: E731
    deny_dot = precision.op_lists(deny=["dot_general"])
    found = input_dtypes(precision.autocast(fn, "mixed_bf16", ops=deny_dot), w,
                         primitives=("dot_general", "exp"))
    assert found["dot_general"] == {"float32"}
    allow_exp = precision.op_lists(allow=["exp"])
    found = input_dtypes(precision.autocast(fn, "mixed_bf16", ops=allow_exp), w, primitives=("exp",))
    assert found["exp"] == {"bfloat16"}
    with pytest.raises(precision.PolicyError, match="dot_genral.*dot_general"):
        precision.op_lists(allow=["dot_genral"])
    with pytest.raises(precision.PolicyError, match="both"):
        precision.op_lists(allow=["exp"], deny=["exp"])


def test_explain_table_names_modules_dtypes_and_islands():
    model, x, kwargs = LINEN["lm"]
    table = str(precision.explain(model, x, policy="mixed_f16", **kwargs))
    for text in ("block_0/Dense_0", "f16", "100%", "float32 islands", "deny-listed", "head"):
        assert text in table, text


def test_output_dtype_and_jit_sharding_under_autocast():
    mesh = jax.make_mesh((1,), ("data",))
    sharding = jax.sharding.NamedSharding(mesh, jax.P("data"))
    x = jax.device_put(jnp.ones((4, 4)), sharding)
    fn = jax.jit(precision.autocast(lambda a: jax.nn.softmax(a @ a), "mixed_f16"), out_shardings=sharding)
    out = fn(x)
    assert out.dtype == jnp.float32 and out.sharding == sharding
    chex.assert_trees_all_close(out, jnp.full((4, 4), 0.25))


def test_autocast_bad_input():
    with pytest.raises(precision.PolicyError):
        precision.autocast(jnp.sin, "params=f32,compute=f17")
    with pytest.raises(TypeError, match="callable"):
        precision.autocast(3, "mixed_bf16")
    with pytest.raises(TypeError, match="policy"):
        precision.explain(lambda a: a, jnp.ones(3))


def test_cli_explain_prints_the_experiment_and_trains_nothing(tmp_path, capsys):
    from train.cli import main

    workdir = tmp_path / "run"
    args = ["configs/default.yaml", f"workdir={workdir}", "precision.policy=mixed_bf16", "model.dtype=float32"]
    assert main(args + ["--explain"]) == 0
    table = capsys.readouterr().out
    assert "MLP under p=f32,c=bf16,o=f32 (autocast)" in table and "Dense_0" in table
    assert "forward 100.0%" in table and "backward 100.0%" in table
    assert not workdir.exists()
    # The train state's bytes by part and under the stored-state presets (issue 41, 7a).
    assert main(args + ["accum_steps=2", "--explain"]) == 0
    lines = capsys.readouterr().out.splitlines()
    state = lines[lines.index(next(line for line in lines if line.startswith("train state:"))):]
    assert state[0].startswith("train state: 16.0 bytes/param (params 4.0, masters 0.0, optimizer 8.0, gradient "
                               "accumulation 4.0 during a step; accum=bf16 would take 2.0)"), state[0]
    assert state[1:3] == ["  under lean_bf16: 10.0 bytes/param", "  under lean_int8: 8.1 bytes/param"], state[1:3]
    assert main(args + ["precision.autocast=false", "precision.strict=true", "steps=1"]) == 2
    assert "precision.strict" in capsys.readouterr().err and not (workdir / "checkpoints").exists()
    assert main(args + ["precision.deny=[dot_genral]", "--explain"]) == 2
    assert "did you mean" in capsys.readouterr().err.lower()
