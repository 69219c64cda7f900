"""The GPT's attention: jax.nn.dot_product_attention (causal, no mask kept for the
backward pass), the same params and outputs as a plain attention, its softmax in
float32 and its two matmuls in the compute dtype under a half policy."""

import collections

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import precision
from benchmarks import measure
from train.models.gpt import GPT, CausalSelfAttention

T, HEADS, D_MODEL, BATCH = 24, 2, 16, 3  # T differs from every other dim: (..., T, T) marks attention logits


def _gpt(**kwargs):
    return GPT(vocab_size=16, block_size=T, num_layers=1, num_heads=HEADS, d_model=D_MODEL, **kwargs)


def _tokens():
    return jax.random.randint(jax.random.key(0), (BATCH, T), 0, 16)


def _reference_attention(params, x, num_heads):
    """softmax(q k^T / sqrt(d) + causal mask) v, written out in float32."""
    b, t, c = x.shape
    d = c // num_heads
    qkv = x @ params["qkv"]["kernel"] + params["qkv"]["bias"]
    q, k, v = jnp.split(qkv.reshape(b, t, 3 * num_heads, d), 3, axis=2)
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(d)
    logits = jnp.where(jnp.tril(jnp.ones((t, t), bool)), logits, -jnp.inf)
    out = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(logits, axis=-1), v)
    return out.reshape(b, t, c) @ params["proj"]["kernel"] + params["proj"]["bias"]


def test_attention_matches_a_plain_reference_in_float32_forward_and_backward():
    attn = CausalSelfAttention(num_heads=4)
    x = jax.random.normal(jax.random.key(1), (BATCH, T, 32))
    params = jax.jit(attn.init)(jax.random.key(2), x)["params"]
    np.testing.assert_allclose(jax.jit(attn.apply)({"params": params}, x), _reference_attention(params, x, 4),
                               rtol=1e-5, atol=1e-5)
    ours = jax.jit(jax.grad(lambda p, x: jnp.sum(jnp.sin(attn.apply({"params": p}, x))), argnums=(0, 1)))(params, x)
    ref = jax.jit(jax.grad(lambda p, x: jnp.sum(jnp.sin(_reference_attention(p, x, 4))), argnums=(0, 1)))(params, x)
    for a, b in zip(jax.tree_util.tree_leaves(ours), jax.tree_util.tree_leaves(ref)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_gpt_keeps_its_parameter_tree_and_rejects_unknown_attention_impls():
    params = jax.jit(_gpt().init)(jax.random.key(0), _tokens())["params"]
    shapes = {jax.tree_util.keystr(k): v.shape for k, v in jax.tree_util.tree_leaves_with_path(params)}
    assert shapes["['block_0']['attn']['qkv']['kernel']"] == (D_MODEL, 3 * D_MODEL)
    assert shapes["['block_0']['attn']['proj']['kernel']"] == (D_MODEL, D_MODEL)
    assert sorted(shapes) == sorted(
        f"['block_0']['{m}']['{p}']" for m, ps in (("Dense_0", ("bias", "kernel")), ("Dense_1", ("bias", "kernel")),
                                                    ("LayerNorm_0", ("bias", "scale")),
                                                    ("LayerNorm_1", ("bias", "scale"))) for p in ps
    ) + [f"['block_0']['attn']['{m}']['{p}']" for m in ("proj", "qkv") for p in ("bias", "kernel")] + [
        "['head']['bias']", "['head']['kernel']", "['ln_f']['bias']", "['ln_f']['scale']",
        "['positions']['embedding']", "['tokens']['embedding']"]
    # the dropout path (explicit probabilities) gives the same logits when nothing is dropped
    same = jax.jit(lambda p, x: _gpt(dropout=1e-9).apply({"params": p}, x, train=True,
                                                         rngs={"dropout": jax.random.key(3)}))(params, _tokens())
    plain = jax.jit(lambda p, x: _gpt().apply({"params": p}, x))(params, _tokens())
    np.testing.assert_allclose(same, plain, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="attention_impl"):
        _gpt(attention_impl="flash").init(jax.random.key(0), _tokens())


def _equations(jaxpr):
    for eqn in jaxpr.eqns:
        yield eqn
        for param in eqn.params.values():  # jit, remat (an open jaxpr), custom_jvp, cond branches
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                inner = sub if hasattr(sub, "eqns") else getattr(sub, "jaxpr", None)
                if inner is not None and hasattr(inner, "eqns"):
                    yield from _equations(inner)


def _square(aval):  # an attention-logits-shaped value: (..., T, T)
    return tuple(getattr(aval, "shape", ())[-2:]) == (T, T)


def _attention_dtypes(policy):
    """{primitive: {operand dtypes}} of the ops touching (..., T, T) values, forward and backward."""
    model = precision.with_policy(_gpt(), policy)
    params = model.init(jax.random.key(0), _tokens())["params"]

    def loss(p):
        logits = model.apply({"params": p}, _tokens()).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, _tokens()).mean()

    found = collections.defaultdict(set)
    for eqn in _equations(jax.make_jaxpr(jax.value_and_grad(loss))(params).jaxpr):
        name = eqn.primitive.name
        if name in ("dot_general", "exp", "reduce_max", "reduce_sum") and any(
                _square(v.aval) for v in [*eqn.invars, *eqn.outvars]):
            found[name].add(tuple(sorted({str(v.aval.dtype) for v in eqn.invars})))
    return found


@pytest.mark.parametrize("policy, half", [("O1", "float16"), ("mixed_bf16", "bfloat16")])
def test_attention_softmax_runs_in_float32_and_its_matmuls_in_half(policy, half):
    found = _attention_dtypes(policy)
    # Q K^T and P V forward, and their four gradients: all with half operands
    assert found["dot_general"] == {(half,)}
    for op in ("exp", "reduce_max", "reduce_sum"):  # the softmax of the logits (and its backward's sum)
        assert found[op] == {("float32",)}, (op, found[op])


def _masks(residuals):
    """Residuals that are masks: boolean or integer (..., T, T) values, or floating ones
    without a full batch x heads of rows (a (T, T) or (1, 1, T, T) additive mask)."""
    out = []
    for dtype, shape, _, source in residuals:
        if len(shape) < 2 or shape[-2:] != (T, T):
            continue
        floating = dtype.startswith(("f", "bf"))
        if not floating or int(np.prod(shape[:-2])) < BATCH * HEADS:
            out.append((dtype, shape, source))
    return out


def _residuals(model, train=False):
    model = precision.with_policy(model, "mixed_bf16")
    params = model.init(jax.random.key(0), _tokens())["params"]

    def loss(p):
        logits = model.apply({"params": p}, _tokens(), train=train, rngs={"dropout": jax.random.key(1)})
        return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), _tokens()).mean()

    return measure.saved_residuals(loss, params)


def test_no_attention_mask_is_saved_for_the_backward_pass_under_mixed_bf16():
    residuals = _residuals(_gpt())
    assert _masks(residuals) == []
    softmax = [r for r in residuals if r[1][-2:] == (T, T)]
    assert softmax and all(r[0] in ("bf16", "f32") for r in softmax)  # the probabilities: activations
    # the explicit path (attention dropout) does keep its boolean mask: what the check would catch
    assert any(m[0] == "bool" for m in _masks(_residuals(_gpt(dropout=0.1), train=True)))
