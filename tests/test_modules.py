"""Applying policies and rules to unmodified Flax Linen and NNX modules."""

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import jmp
import numpy as np
import pytest
from flax import nnx

import precision
from precision.program import iter_ops, matmul_ops
from precision.rules import Resolver, as_rules, match_rule

X = jnp.linspace(-1.0, 1.0, 4 * 5).reshape(4, 5)
dtype_tree = lambda tree: jax.tree_util.tree_map(lambda x: x.dtype, tree)


class Net(nn.Module):
    """A plain Linen model: no precision code inside."""

    @nn.compact
    def __call__(self, x, train: bool = True):
        seen = {}
        x = nn.Dense(8)(x)
        seen["dense"] = x.dtype
        x = nn.LayerNorm()(x)
        seen["norm"] = x.dtype
        x = nn.BatchNorm(use_running_average=not train)(x)
        x = Block(name="block")(x)
        self.sow("intermediates", "dtypes", str(seen))
        return nn.Dense(3)(x)


class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.relu(nn.Dense(8, name="attn")(x))


def dtypes_seen(model, variables):
    """What the model's Python code saw while tracing (autocast traces in float32)."""
    _, state = model.apply(variables, X, mutable=["batch_stats", "intermediates"])
    return state["intermediates"]["dtypes"][0]


def program_dtypes(fn, *args):
    """{module path: dtypes of its matmul operands} and {primitive: input dtypes}
    of the program ``fn`` runs (as rewritten by autocast)."""
    jaxpr = jax.make_jaxpr(fn)(*args)
    matmuls = {}
    for m in matmul_ops(jaxpr):
        matmuls.setdefault("/".join(m.path), set()).add(m.dtype.name)  # module paths, as params and rules
    ops = {}
    for op in iter_ops(jaxpr):
        ops.setdefault(op.primitive, set()).update(d.name for d in op.in_dtypes if jnp.issubdtype(d, jnp.floating))
    return matmuls, ops


class LinenTest(chex.TestCase):

    @chex.variants(with_jit=True, without_jit=True)
    def test_mixed_policy_params_compute_output_and_grads(self):
        model = precision.with_policy(Net(), "mixed_f16")
        variables = model.init(jax.random.key(0), X)
        assert all(d == jnp.float32 for d in jax.tree_util.tree_leaves(dtype_tree(variables)))

        def loss(params):
            out, state = model.apply({**variables, "params": params}, X, mutable=["batch_stats"])
            return jnp.sum(out.astype(jnp.float32) ** 2), (out, state)

        grads, (out, state) = self.variant(jax.grad(loss, has_aux=True))(variables["params"])
        assert out.dtype == jnp.float32  # output dtype
        assert all(d == jnp.float32 for d in jax.tree_util.tree_leaves(dtype_tree(grads)))
        assert all(d == jnp.float32 for d in jax.tree_util.tree_leaves(dtype_tree(state)))
        matmuls, ops = program_dtypes(lambda p: jax.grad(lambda q: loss(q)[0])(p), variables["params"])
        assert matmuls == {"Dense_0": {"float16"}, "block/attn": {"float16"}, "Dense_1": {"float16"}}
        assert ops["rsqrt"] == {"float32"} and "float32" in ops["reduce_sum"]  # norm statistics
        # autocast traces the float32 program: the model's own code sees float32
        assert dtypes_seen(model, variables) == str({"dense": jnp.dtype("float32"), "norm": jnp.dtype("float32")})

    def test_default_rules_keep_norms_in_f32_inside(self):
        class Gate(nn.Module):  # only elementwise ops: half unless a rule says otherwise
            @nn.compact
            def __call__(self, x):
                return x * nn.sigmoid(x)

        class Spy(nn.Module):
            @nn.compact
            def __call__(self, x):
                x = Gate()(nn.Dense(4)(x))
                return nn.Dense(3, name="head")(nn.LayerNorm()(x))

        def ops_of(rules):
            model = precision.with_policy(Spy(), "mixed_f16", rules)
            variables = model.init(jax.random.key(0), X)
            jaxpr = jax.make_jaxpr(lambda v: model.apply(v, X))(variables)
            found = {}
            for op in iter_ops(jaxpr):  # the dtype each op computes in
                floats = {d.name for d in op.out_dtypes if jnp.issubdtype(d, jnp.floating)}
                found.setdefault(op.path[-1] if op.path else "", {}).setdefault(op.primitive, set()).update(floats)
            return variables, found

        variables, found = ops_of(None)
        assert dtype_tree(variables["params"])["LayerNorm_0"]["scale"] == jnp.float32
        assert all(d == {"float32"} for d in found["LayerNorm_0"].values())  # the norm computes in f32
        assert found["Gate_0"]["mul"] == {"float16"} and found["head"]["dot_general"] == {"float16"}
        _, found = ops_of([("LayerNorm", "f32"), ("Gate", "f32"), ("head", "f32")])
        assert found["Gate_0"]["mul"] == {"float32"} and found["head"]["dot_general"] == {"float32"}
        assert found["Dense_0"]["dot_general"] == {"float16"}

    def test_half_params_and_f32_norm_params_under_o2(self):
        model = precision.with_policy(Net(), "O2")
        variables = model.init(jax.random.key(0), X)
        params = dtype_tree(variables["params"])
        assert params["Dense_0"]["kernel"] == jnp.float16 and params["block"]["attn"]["kernel"] == jnp.float16
        assert params["LayerNorm_0"]["scale"] == jnp.float32 and params["BatchNorm_0"]["scale"] == jnp.float32
        assert dtype_tree(variables["batch_stats"])["BatchNorm_0"]["mean"] == jnp.float32

    def test_batch_stats_stay_f32_without_norm_rules(self):
        model = precision.with_policy(Net(), "pure_f16", rules=[])
        variables = model.init(jax.random.key(0), X)
        assert dtype_tree(variables["params"])["BatchNorm_0"]["scale"] == jnp.float16
        out, state = model.apply(variables, X, mutable=["batch_stats"])
        assert out.dtype == jnp.float16
        assert all(d == jnp.float32 for d in jax.tree_util.tree_leaves(dtype_tree(state)))

    def test_rule_by_path_covers_children_and_first_match_wins(self):
        def param_dtypes(rules):
            model = precision.with_policy(Net(), "pure_f16", rules=rules)
            return dtype_tree(model.init(jax.random.key(0), X)["params"])

        inherited = param_dtypes([("block", "f32")])
        assert inherited["block"]["attn"]["kernel"] == jnp.float32  # child of a matched module
        assert inherited["Dense_0"]["kernel"] == jnp.float16 and inherited["BatchNorm_0"]["scale"] == jnp.float16
        # "attn" (path) and "Dense" (class) both match block/attn: the first rule wins.
        assert param_dtypes([("attn", "bf16"), ("Dense", "f32")])["block"]["attn"]["kernel"] == jnp.bfloat16
        assert param_dtypes([("Dense", "f32"), ("attn", "bf16")])["block"]["attn"]["kernel"] == jnp.float32
        # A module's own rule beats its parent's.
        assert param_dtypes([("block", "f32"), ("attn", "bf16")])["block"]["attn"]["kernel"] == jnp.bfloat16

    def test_f32_model_under_mixed_matches_reference_closely(self):
        ref = Net()
        variables = ref.init(jax.random.key(0), X)
        out_ref, _ = ref.apply(variables, X, mutable=["batch_stats"])
        for spec, tol in (("fp32", 0), ("mixed_bf16", 5e-2), ("mixed_f16", 1e-2)):
            model = precision.with_policy(Net(), spec)
            out, _ = model.apply(variables, X, mutable=["batch_stats"])
            np.testing.assert_allclose(out, out_ref, atol=tol, rtol=tol)

    def test_jmp_policy_and_policy_objects_are_accepted(self):
        model = precision.with_policy(Net(), jmp.get_policy("p=f32,c=bf16,o=f32"))
        variables = model.init(jax.random.key(0), X)
        out, _ = model.apply(variables, X, mutable=["batch_stats"])
        assert out.dtype == jnp.float32
        matmuls, _ = program_dtypes(lambda v: model.apply(v, X, mutable=["batch_stats"]), variables)
        assert set().union(*matmuls.values()) == {"bfloat16"}

    def test_apply_on_a_fresh_wrapper_and_cast_params(self):
        variables = Net().init(jax.random.key(0), X)  # plain f32 weights, e.g. loaded from disk
        model = precision.with_policy(Net(), "O2")
        with pytest.raises(ValueError, match="pass sample inputs"):
            model.cast_params(variables)  # class-name rules (BatchNorm in f32) need the structure
        stored = model.cast_params(variables, X, mutable=["batch_stats"])
        assert dtype_tree(stored["params"])["Dense_0"]["kernel"] == jnp.float16
        assert dtype_tree(stored["params"])["BatchNorm_0"]["scale"] == jnp.float32
        out, _ = jax.jit(lambda v: model.apply(v, X, mutable=["batch_stats"]))(stored)
        assert out.dtype == jnp.float32 and np.isfinite(out).all()

    def test_integer_inputs_are_untouched(self):
        class Emb(nn.Module):
            @nn.compact
            def __call__(self, tokens):
                return nn.Dense(2)(nn.Embed(10, 4)(tokens))

        model = precision.with_policy(Emb(), "mixed_bf16")
        tokens = jnp.arange(6).reshape(2, 3)
        out = model.apply(model.init(jax.random.key(0), tokens), tokens)
        assert out.dtype == jnp.float32 and out.shape == (2, 3, 2)


def test_with_policy_rejects_what_it_cannot_wrap():
    with pytest.raises(TypeError, match="flax.linen.Module or flax.nnx.Module"):
        precision.with_policy(lambda x: x, "mixed_f16")
    with pytest.raises(precision.PolicyError):
        precision.with_policy(Net(), "mixed_f17")
    with pytest.raises(TypeError, match=r"rules\[0\]"):
        precision.with_policy(Net(), "mixed_f16", rules=["LayerNorm"])
    with pytest.raises(precision.PolicyError, match=r"rules\[1\] \('attn'\)"):
        precision.with_policy(Net(), "mixed_f16", rules=[("LayerNorm", "f32"), ("attn", "f61")])


def test_rule_matching():
    rules = as_rules([("LayerNorm", "f32"), ("encoder/*/attn", "bf16"), ("mlp", "f16")])
    assert match_rule(rules, "encoder/block_3/ln", ("LayerNorm", "Module")).pattern == "LayerNorm"
    assert match_rule(rules, "encoder/block_3/attn", ("Attention",)).pattern == "encoder/*/attn"
    assert match_rule(rules, "decoder/block_3/attn", ("Attention",)) is None
    assert match_rule(rules, "decoder/block_0/mlp", ("MLP",)).pattern == "mlp"
    assert match_rule(rules, "decoder/block_0/mlp_out", ("Dense",)) is None
    resolve = Resolver(precision.get_policy("pure_f16"), rules, {("decoder", "block_0", "mlp"): ("MLP",)})
    assert resolve(("decoder", "block_0", "mlp", "Dense_0")).compute_dtype == jnp.float16
    assert resolve(("encoder", "b", "attn", "Dense_0")).param_dtype == jnp.bfloat16  # inherited


def test_preset_rules():
    norms = set(precision.NORM_CLASSES)
    assert {r.pattern for r in precision.get_rules("mixed_f16")} == norms
    assert {r.pattern for r in precision.get_rules("O1")} == norms | set(precision.SOFTMAX_PATTERNS)
    assert precision.get_rules("O3") == ()
    assert all(r.policy == precision.get_policy("f32") for r in precision.get_rules("O1"))
    assert precision.with_policy(Net(), "O3").rules == ()
    assert precision.with_policy(Net(), precision.get_policy("O3")).rules == precision.default_rules()


# ----------------------------------------------------------------------------- NNX


class NNXNet(nnx.Module):
    """A plain NNX model: no precision code inside."""

    def __init__(self, rngs):
        self.dense = nnx.Linear(5, 8, rngs=rngs)
        self.norm = nnx.LayerNorm(8, rngs=rngs)
        self.bn = nnx.BatchNorm(8, rngs=rngs)
        self.out = nnx.Linear(8, 3, rngs=rngs)
        self.seen = {}

    def __call__(self, x):
        h = self.dense(x)
        self.seen["dense"] = h.dtype
        h = self.norm(h)
        self.seen["norm"] = h.dtype
        return self.out(self.bn(h))


def test_nnx_policy_params_state_output_and_grads():
    model = precision.with_policy(NNXNet(nnx.Rngs(0)), "O2")
    params = nnx.state(model, nnx.Param)
    assert params["module"]["dense"]["kernel"].value.dtype == jnp.float16
    assert params["module"]["norm"]["scale"].value.dtype == jnp.float32
    out = model(X)
    assert out.dtype == jnp.float32
    stats = nnx.state(model, nnx.BatchStat)
    assert stats["module"]["bn"]["mean"].value.dtype == jnp.float32
    assert float(jnp.abs(stats["module"]["bn"]["mean"].value).sum()) > 0  # statistics were updated

    grads = nnx.grad(lambda m: jnp.sum(m(X) ** 2))(model)
    leaves = jax.tree_util.tree_leaves(grads)
    assert {x.dtype for x in leaves} == {jnp.dtype("float16"), jnp.dtype("float32")}
    assert all(np.isfinite(np.asarray(x, np.float32)).all() for x in leaves)


def test_nnx_rules_and_compute_dtypes_inside():
    class Gate(nnx.Module):
        def __call__(self, x):
            return x * jax.nn.sigmoid(x)

    def ops_of(spec, rules=None):
        net = NNXNet(nnx.Rngs(0))
        net.gate = Gate()
        net.__class__ = type("GatedNet", (NNXNet,), {"__call__": lambda self, x: self.out(self.bn(self.norm(
            self.gate(self.dense(x)))))})
        wrapped = precision.with_policy(net, spec, rules)
        graphdef, state = nnx.split(wrapped)
        jaxpr = jax.make_jaxpr(lambda s: nnx.merge(graphdef, s)(X))(state)
        found = {}
        for op in iter_ops(jaxpr):
            floats = {d.name for d in op.in_dtypes if jnp.issubdtype(d, jnp.floating)}
            found.setdefault(op.path[-1] if op.path else "", {}).setdefault(op.primitive, set()).update(floats)
        return net, wrapped, found

    net, wrapped, found = ops_of("mixed_f16")
    assert wrapped(X).dtype == jnp.float32
    assert found["dense"]["dot_general"] == {"float16"} and found["gate"]["mul"] == {"float16"}
    assert found["norm"]["rsqrt"] == {"float32"} and found["norm"]["reduce_sum"] == {"float32"}
    assert type(net.norm) is nnx.LayerNorm  # the user's modules are not modified
    assert all(p.value.dtype == jnp.float32 for p in jax.tree_util.tree_leaves(
        nnx.state(wrapped, nnx.Param), is_leaf=lambda x: isinstance(x, nnx.Variable)))
    _, _, found = ops_of("mixed_f16", [("gate", "f32")])
    assert found["gate"]["mul"] == {"float32"} and found["dense"]["dot_general"] == {"float16"}
    _, wrapped3, found = ops_of("O3")  # no rules: half params and output, norm statistics still f32
    assert wrapped3(X).dtype == jnp.float16 and found["norm"]["rsqrt"] == {"float32"}


def test_nnx_matches_linen_semantics_for_jitted_training_step():
    model = precision.with_policy(NNXNet(nnx.Rngs(0)), "mixed_bf16")
    optimizer = nnx.Optimizer(model, precision.mixed_precision(__import__("optax").sgd(0.1),
                                                               precision.NoOpLossScale()), wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer):
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean(m(X) ** 2))(model)
        optimizer.update(model, grads)
        return loss

    losses = [float(step(model, optimizer)) for _ in range(5)]
    assert losses[-1] < losses[0]
