"""``jax.nn.dot_product_attention`` under autocast: called again in the compute
dtype (so a GPU gets cuDNN's fused kernel), its softmax still float32, the
library's interception never visible outside an autocast trace."""

import threading

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import precision
from precision import fused_attention
from precision.program import matmul_ops

B, T, H, D = 2, 12, 2, 8


class UserAttention(nn.Module):
    """Attention the way a user writes it with jax.nn: projections, a padding mask, a bias."""

    causal: bool = False
    with_bias: bool = False

    @nn.compact
    def __call__(self, x, lengths):
        q, k, v = (nn.DenseGeneral((H, D), name=n)(x) for n in ("q", "k", "v"))
        mask = (jnp.arange(T)[None, :] < lengths[:, None])[:, None, None, :]  # (B, 1, 1, T) keys kept
        bias = self.param("bias", nn.initializers.normal(0.1), (1, H, T, T)) if self.with_bias else None
        out = jax.nn.dot_product_attention(q, k, v, bias=bias, mask=None if self.causal else mask,
                                           is_causal=self.causal)
        return nn.DenseGeneral(16, axis=(-2, -1), name="out")(out)


def _inputs():
    x = jax.random.normal(jax.random.key(0), (B, T, 16))
    return x, jnp.array([T, 7], jnp.int32)


@pytest.fixture
def gpu(monkeypatch):
    """A pretend GPU: cuDNN calls run XLA's attention in the same dtype (bfloat16
    works on CPU), or raise where ``gpu.cudnn`` is False; records every call as
    ``(query dtype, implementation)``."""
    original = fused_attention._ORIGINAL

    class Recorder(list):
        cudnn = True
        backward = True  # False: cuDNN refuses only when its backward pass is built

    calls = Recorder()

    def pretend(*args, **kwargs):
        query = kwargs.get("query", args[0] if args else None)
        calls.append((np.dtype(query.dtype), kwargs.get("implementation")))
        if kwargs.get("implementation") == "cudnn":
            if not calls.cudnn:
                raise NotImplementedError("cuDNN is not available")  # what an old cuDNN says
            kwargs = {**kwargs, "implementation": None}
            if not calls.backward:
                return _forward_only(lambda: original(*args, **kwargs), query)
        return original(*args, **kwargs)

    monkeypatch.setattr(fused_attention, "_ORIGINAL", pretend)
    monkeypatch.setattr(fused_attention, "_cudnn_capable", lambda: True)
    return calls


def _forward_only(compute, query):
    @jax.custom_vjp
    def attention(q):
        return compute()

    def backward(_, ct):
        raise ValueError("cuDNN: this case is not supported in training")  # as cuDNN's backward checks say

    attention.defvjp(lambda q: (compute(), None), backward)
    return attention(query)


def _model_and_params(**options):
    model = UserAttention(**options)
    x, lengths = _inputs()
    return model, model.init(jax.random.key(1), x, lengths)["params"], x, lengths


@pytest.mark.parametrize("causal,with_bias", [(False, False), (True, False), (False, True)])
def test_on_a_gpu_attention_is_called_again_as_cudnn_in_half(gpu, causal, with_bias):
    model, params, x, lengths = _model_and_params(causal=causal, with_bias=with_bias)
    gpu.clear()
    out = precision.with_policy(model, "mixed_bf16").apply({"params": params}, x, lengths)
    # Traced in float32 (once or twice: the module structure is recorded once), then made again.
    assert gpu[-1] == (np.dtype(jnp.bfloat16), "cudnn")
    assert set(gpu) == {(np.dtype(np.float32), None), (np.dtype(jnp.bfloat16), "cudnn")}
    reference = model.apply({"params": params}, x, lengths)
    assert out.dtype == jnp.float32
    np.testing.assert_allclose(out, reference, atol=0.05, rtol=0.05)
    assert not np.allclose(out, reference, atol=1e-6)  # it did compute in bfloat16
    explanation = precision.explain(model, x, lengths, policy="mixed_bf16")
    assert explanation.half_share == 1.0


def test_where_cudnn_cannot_take_it_the_attention_is_cast_op_by_op(gpu):
    gpu.cudnn = False
    model, params, x, lengths = _model_and_params(causal=True)
    gpu.clear()
    out = precision.with_policy(model, "mixed_bf16").apply({"params": params}, x, lengths)
    # cuDNN tried, refused: the traced attention is rewritten instead.
    assert gpu[-1] == (np.dtype(jnp.bfloat16), "cudnn")
    assert set(gpu) == {(np.dtype(np.float32), None), (np.dtype(jnp.bfloat16), "cudnn")}
    np.testing.assert_allclose(out, model.apply({"params": params}, x, lengths), atol=0.05, rtol=0.05)


def test_grad_inside_autocast_on_a_gpu_makes_the_whole_call_again(gpu):
    q = jax.random.normal(jax.random.key(2), (B, T, H, D))

    def f(q):  # the transformation runs inside the autocast function: JAX splits the marked call
        return jax.grad(lambda q: jax.nn.dot_product_attention(q, q, q, is_causal=True).sum())(q)

    got = precision.autocast(f, "mixed_bf16")(q)
    np.testing.assert_allclose(got, f(q), atol=0.1, rtol=0.1)


def test_a_cudnn_call_whose_backward_cuDNN_refuses_falls_back_before_any_gradient(gpu):
    gpu.backward = False
    model, params, x, lengths = _model_and_params()
    remat = precision.with_policy(nn.remat(UserAttention)(), "mixed_bf16")  # its backward is built later

    def loss(p):
        return remat.apply({"params": p}, x, lengths).astype(jnp.float32).sum()

    grads = jax.grad(loss)(params)
    reference = jax.grad(lambda p: model.apply({"params": p}, x, lengths).sum())(params)
    for g, r in zip(jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(reference)):
        np.testing.assert_allclose(g, r, atol=0.1, rtol=0.1)


def test_float32_compute_never_goes_to_cudnn(gpu):
    model, params, x, lengths = _model_and_params(causal=True)
    gpu.clear()
    precision.with_policy(model, "fp32").apply({"params": params}, x, lengths)
    assert set(gpu) == {(np.dtype(np.float32), None)}

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x, lengths):
            return UserAttention(name="attn")(x, lengths)

    params = Block().init(jax.random.key(1), x, lengths)["params"]
    gpu.clear()
    precision.with_policy(Block(), "mixed_bf16", rules=[("attn", "f32")]).apply({"params": params}, x, lengths)
    assert set(gpu) == {(np.dtype(np.float32), None)}  # a float32 rule keeps it float32


def test_a_model_that_asks_for_cudnn_traces_under_autocast(gpu):
    from train.models import GPT

    gpt = GPT(vocab_size=16, block_size=8, num_layers=1, num_heads=2, d_model=16, attention_impl="cudnn")
    tokens = jnp.arange(16).reshape(2, 8) % 16
    params = gpt.clone(attention_impl=None).init(jax.random.key(0), tokens)["params"]
    gpu.clear()
    logits = precision.with_policy(gpt, "mixed_bf16").apply({"params": params}, tokens)
    assert (np.dtype(jnp.bfloat16), "cudnn") in gpu and np.all(np.isfinite(logits))


@pytest.mark.parametrize("policy", ["mixed_bf16", "mixed_f16"])
def test_off_gpu_every_attention_matmul_is_half_and_the_softmax_float32(policy):
    model, params, x, lengths = _model_and_params()
    wrapped = precision.with_policy(model, policy)

    def loss(p):
        return wrapped.apply({"params": p}, x, lengths).astype(jnp.float32).sum()

    jaxpr = jax.make_jaxpr(jax.grad(loss))(params)
    ops = matmul_ops(jaxpr)
    assert ops and all(op.half for op in ops)
    exps = [e for e in _eqns(jaxpr.jaxpr) if e.primitive.name == "exp"]
    assert exps and all(e.outvars[0].aval.dtype == jnp.float32 for e in exps)
    assert precision.explain(model, x, lengths, policy=policy).half_share == 1.0
    out = wrapped.apply({"params": params}, x, lengths)
    np.testing.assert_allclose(out, model.apply({"params": params}, x, lengths), atol=0.05, rtol=0.05)
    jax.block_until_ready(jax.jit(jax.grad(loss))(params))  # and compiles (float16 dot algorithms would not on CPU)
    assert fused_attention.MARK not in jax.jit(jax.grad(loss)).lower(params).as_text()  # the mark is gone


def test_parts_of_a_marked_call_split_off_by_a_transformation_lose_the_mark_too():
    """``jax.grad`` inside the autocast function splits the marked call into parts that keep
    its name; rewritten op by op, none may keep the long mark as the name of a program (eagerly
    compiled, it named a persistent-cache file too long for the filesystem)."""
    q = jax.random.normal(jax.random.key(2), (B, T, H, D))

    def f(q):
        return jax.grad(lambda q: jax.nn.dot_product_attention(q, q, q, is_causal=True).sum())(q)

    jaxpr = jax.make_jaxpr(precision.autocast(f, "mixed_bf16"))(q)
    names = [str(e.params.get("name", "")) for e in _eqns(jaxpr.jaxpr)]
    assert not [n for n in names if n.startswith(fused_attention.MARK)]
    np.testing.assert_allclose(precision.autocast(f, "mixed_bf16")(q), f(q), atol=0.1, rtol=0.1)


def _eqns(jaxpr):
    for eqn in jaxpr.eqns:
        yield eqn
        for value in eqn.params.values():
            inner = getattr(value, "jaxpr", value)
            if hasattr(inner, "eqns"):
                yield from _eqns(inner)


def test_the_interception_is_gone_after_autocast_even_when_the_model_fails():
    assert jax.nn.dot_product_attention is fused_attention._ORIGINAL

    def broken(q):
        jax.nn.dot_product_attention(q, q, q)
        raise RuntimeError("the model's own error")

    with pytest.raises(RuntimeError, match="the model's own error"):
        precision.autocast(broken, "mixed_bf16")(jnp.ones((B, T, H, D)))
    assert jax.nn.dot_product_attention is fused_attention._ORIGINAL


def test_concurrent_autocasts_and_plain_calls_each_get_their_own_attention():
    q = jax.random.normal(jax.random.key(2), (B, T, H, D))
    f = lambda q: jax.nn.dot_product_attention(q, q, q, is_causal=True)  # noqa: E731
    expected_half = precision.autocast(f, "mixed_bf16")(q)
    expected_full = f(q)
    results, errors = [], []

    def work(i):
        try:
            results.append((i % 2, precision.autocast(f, "mixed_bf16")(q) if i % 2 else f(q)))
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(results) == 16
    for half, out in results:
        np.testing.assert_array_equal(out, expected_half if half else expected_full)
    assert jax.nn.dot_product_attention is fused_attention._ORIGINAL


def test_an_attention_imported_before_is_cast_op_by_op():
    from jax.nn import dot_product_attention as bound_early  # bypasses the module attribute

    q = jax.random.normal(jax.random.key(2), (B, T, H, D))
    f = lambda q: bound_early(q, q, q, is_causal=True).sum()  # noqa: E731
    jaxpr = jax.make_jaxpr(jax.grad(precision.autocast(f, "mixed_bf16")))(q)
    ops = matmul_ops(jaxpr)
    assert ops and all(op.half for op in ops)
    np.testing.assert_allclose(precision.autocast(f, "mixed_bf16")(q), f(q), rtol=0.02)


def test_a_model_pinned_to_cudnn_still_runs_under_autocast_where_there_is_none():
    from train.models import GPT

    gpt = GPT(vocab_size=16, block_size=8, num_layers=1, num_heads=2, d_model=16)
    tokens = jnp.arange(16).reshape(2, 8) % 16
    params = gpt.init(jax.random.key(0), tokens)["params"]
    pinned = precision.with_policy(gpt.clone(attention_impl="cudnn"), "mixed_bf16")
    if jax.default_backend() == "gpu":
        pytest.skip("this checks the fallback where cuDNN is missing")
    got = pinned.apply({"params": params}, tokens)  # cuDNN refused here: the traced attention, cast op by op
    want = precision.with_policy(gpt, "mixed_bf16").apply({"params": params}, tokens)
    np.testing.assert_array_equal(got, want)
