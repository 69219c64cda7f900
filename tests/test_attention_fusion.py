"""Softmax attention a model writes out, computed as one fused attention call.

On a CPU the program keeps the written-out attention (``platform_dependent``'s
default branch); these tests stand a pretend cuDNN in (XLA's attention in the
same dtype) and, where they check the fused numbers, make the lowering take the
CUDA branch. The H100 programs themselves are checked in test_compile_for.
"""

import importlib.util
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import precision
from attention_models import HEADS, T, WIDTH, LinenFunctionAttention, NNXDropoutAttention, SownWeights, WrittenOut
from helpers import ROOT
from precision.autocast import attention_fusion, fused_attention

sys.path.insert(0, str(ROOT / "examples" / "user_models"))
import hf_style  # noqa: E402
import linen_gpt  # noqa: E402

VOCAB = 32


@pytest.fixture
def cudnn(monkeypatch):
    """A pretend cuDNN (XLA's attention in the same dtype); calls recorded as (dtype, is_causal,
    mask given, bias given)."""
    original = fused_attention._ORIGINAL
    calls = []

    def pretend(*args, **kwargs):
        if kwargs.get("implementation") == "cudnn":
            calls.append((np.dtype(kwargs["query"].dtype), kwargs.get("is_causal"), kwargs.get("mask") is not None,
                          kwargs.get("bias") is not None))
            kwargs = {**kwargs, "implementation": None}
        return original(*args, **kwargs)

    monkeypatch.setattr(fused_attention, "_ORIGINAL", pretend)
    monkeypatch.setattr(fused_attention, "_cudnn_capable", lambda: True)
    return calls


@pytest.fixture
def lowered_for_cuda(monkeypatch):
    """The programs' platform choices take their CUDA branch (run here, on the CPU)."""
    monkeypatch.setattr(attention_fusion, "platform_dependent", lambda operands, cuda, default, **_: cuda(operands))


def _tokens(batch=2):
    return jax.random.randint(jax.random.key(0), (batch, T), 0, VOCAB)


def _padding():
    return jnp.ones((2, T), jnp.int32).at[1, 10:].set(0)


LANGUAGE_MODELS = {
    "linen SelfAttention GPT": lambda: linen_gpt.GPT(VOCAB, T, WIDTH, HEADS, 2),
    "HF-style GPT-2": lambda: hf_style.GPT2(VOCAB, T, WIDTH, HEADS, 2),
    "HF-style Llama (grouped kv heads)": lambda: hf_style.Llama(VOCAB, T, WIDTH, HEADS, 2, 2),
}


@pytest.mark.parametrize("name", LANGUAGE_MODELS)
def test_causal_attention_written_out_is_fused_in_every_layer_and_explain_says_so(cudnn, name):
    model = LANGUAGE_MODELS[name]()
    explanation = precision.explain(model, _tokens(), policy="mixed_bf16")
    assert len(explanation.attention) == 2 and len(explanation.fused_attention) == 2, explanation.attention
    assert all("causal" in how for _, how in explanation.attention)
    assert "attention: 2 of 2 fused" in str(explanation)
    cudnn.clear()
    precision.with_policy(model, "mixed_bf16").apply(model.init(jax.random.key(1), _tokens()), _tokens())
    assert cudnn and set(cudnn) == {(np.dtype(jnp.bfloat16), True, False, False)}  # is_causal: no mask array


@pytest.mark.parametrize("name", ["HF-style GPT-2", "HF-style Llama (grouped kv heads)"])
def test_a_padding_mask_goes_to_the_fused_call_as_mask_or_bias(cudnn, name):
    model = LANGUAGE_MODELS[name]()
    explanation = precision.explain(model, _tokens(), _padding(), policy="mixed_bf16")
    assert len(explanation.fused_attention) == 2
    assert all(": bias)" in how or ": mask)" in how for _, how in explanation.attention)


def _fused_and_unfused(model, variables, *args, policy="mixed_bf16", monkeypatch=None):
    wrapped = precision.with_policy(model, policy)
    unfused = wrapped.apply(variables, *args)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(attention_fusion, "platform_dependent", lambda operands, cuda, default, **_: cuda(operands))
        fused = wrapped.apply(variables, *args)
    return fused, unfused


CASES = {
    "linen SelfAttention GPT (causal)": (lambda: linen_gpt.GPT(VOCAB, T, WIDTH, HEADS, 2), lambda: (_tokens(),)),
    "HF-style GPT-2 with padding": (lambda: hf_style.GPT2(VOCAB, T, WIDTH, HEADS, 2),
                                    lambda: (_tokens(), _padding())),
    "HF-style Llama with padding": (lambda: hf_style.Llama(VOCAB, T, WIDTH, HEADS, 2, 2),
                                    lambda: (_tokens(), _padding())),
    "linen dot_product_attention, lengths": (LinenFunctionAttention, lambda: (
        jax.random.normal(jax.random.key(2), (2, T, WIDTH)), jnp.array([T, 9]))),
}


#: Every case in bfloat16; float16 (the same code path, another dtype) on the padded GPT-2.
NUMERICS = [(name, "mixed_bf16") for name in CASES] + [("HF-style GPT-2 with padding", "mixed_f16")]


@pytest.mark.parametrize("name,policy", NUMERICS, ids=[f"{n}-{p}" for n, p in NUMERICS])
def test_fused_outputs_and_gradients_match_the_unfused_half_attention(cudnn, name, policy):
    make, inputs = CASES[name]
    model, args = make(), inputs()
    variables = model.init(jax.random.key(1), *args)
    fused, unfused = _fused_and_unfused(model, variables, *args, policy=policy)
    reference = model.apply(variables, *args)
    assert cudnn, "the fused call was not made"
    # Within half precision of the unfused half attention, and no further from float32 than it.
    np.testing.assert_allclose(fused, unfused, atol=0.06, rtol=0.06)
    assert np.abs(fused - reference).max() <= 1.5 * np.abs(unfused - reference).max() + 1e-3

    wrapped = precision.with_policy(model, policy)

    def loss(params):
        return jnp.mean(wrapped.apply({"params": params}, *args).astype(jnp.float32) ** 2)

    unfused_grads = _flat(jax.grad(loss)(variables["params"]))
    with pytest.MonkeyPatch.context() as m:
        m.setattr(attention_fusion, "platform_dependent", lambda operands, cuda, default, **_: cuda(operands))
        fused_grads = _flat(jax.grad(loss)(variables["params"]))
    exact = _flat(jax.grad(lambda p: jnp.mean(model.apply({"params": p}, *args) ** 2))(variables["params"]))
    assert np.linalg.norm(fused_grads - unfused_grads) <= 0.05 * np.linalg.norm(unfused_grads)
    assert np.linalg.norm(fused_grads - exact) <= 1.5 * np.linalg.norm(unfused_grads - exact) + 1e-6


def _flat(tree):
    return np.concatenate([np.ravel(np.asarray(x, np.float32)) for x in jax.tree_util.tree_leaves(tree)])


def test_on_the_cpu_the_program_keeps_the_written_out_attention_bit_for_bit(cudnn):
    """The lowering for a CPU takes the default branch: the same numbers as with fusion off."""
    model = linen_gpt.GPT(VOCAB, T, WIDTH, HEADS, 2)
    variables = model.init(jax.random.key(1), _tokens())
    on = precision.with_policy(model, "mixed_bf16").apply(variables, _tokens())
    off = precision.with_policy(model, "mixed_bf16", ops=precision.op_lists(fuse_attention=False)).apply(
        variables, _tokens())
    assert cudnn and np.array_equal(on, off)


def test_training_with_fused_attention_follows_the_unfused_losses_for_200_steps(cudnn):
    model = linen_gpt.GPT(VOCAB, T, WIDTH, HEADS, 2)
    tokens = jax.random.randint(jax.random.key(3), (8, T + 1), 0, VOCAB)
    tokens = tokens.at[:, 1::2].set((tokens[:, ::2][:, :tokens[:, 1::2].shape[1]] + 1) % VOCAB)  # learnable
    wrapped = precision.with_policy(model, "mixed_bf16")
    optimizer = optax.adam(3e-3)

    def losses():
        params = model.init(jax.random.key(1), tokens[:, :-1])["params"]
        state = optimizer.init(params)

        @jax.jit
        def step(params, state):
            def loss(p):
                logits = wrapped.apply({"params": p}, tokens[:, :-1]).astype(jnp.float32)
                return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

            value, grads = jax.value_and_grad(loss)(params)
            updates, state = optimizer.update(grads, state, params)
            return optax.apply_updates(params, updates), state, value

        out = []
        for _ in range(200):
            params, state, value = step(params, state)
            out.append(float(value))
        return np.array(out)

    unfused = losses()
    with pytest.MonkeyPatch.context() as m:
        m.setattr(attention_fusion, "platform_dependent", lambda operands, cuda, default, **_: cuda(operands))
        fused = losses()
    assert unfused[-1] < 0.75 * unfused[0]  # it learns
    np.testing.assert_allclose(fused[-20:].mean(), unfused[-20:].mean(), rtol=0.05)
    assert np.abs(fused - unfused).max() < 0.15


# ----------------------------------------------------------------------------- never wrong


def _report(model, *args, policy="mixed_bf16", **kwargs):
    return precision.explain(model, *args, policy=policy, **kwargs).attention


def test_attention_that_is_not_the_same_computation_is_left_as_it_is_with_why(cudnn):
    x = jax.random.normal(jax.random.key(2), (2, T, WIDTH))
    returned = _report(WrittenOut(returns_probabilities=True), x)
    assert returned and "read outside the attention" in returned[0][1]
    # Weights sown and collected are read: not fused. Sown into a collection nobody collects, nothing reads them.
    sown, variables = SownWeights(), SownWeights().init(jax.random.key(1), x)
    cudnn.clear()
    _, collected = precision.with_policy(sown, "mixed_bf16").apply(variables, x, mutable=["intermediates"])
    assert not cudnn and jax.tree_util.tree_leaves(collected["intermediates"])[0].shape == (2, HEADS, T, T)
    precision.with_policy(sown, "mixed_bf16").apply(variables, x)
    assert cudnn
    dropped = precision.explain(NNXDropoutAttention(rngs=nnx.Rngs(0, dropout=1)), x, policy="mixed_bf16").attention
    assert dropped and "dropped out" in dropped[0][1]
    # A softmax over another axis, logits capped by tanh: no attention to fuse, none fused.
    for model in (WrittenOut(axis=-2), WrittenOut(cap=30.0)):
        assert not [how for _, how in _report(model, x) if not how.startswith("not fused")]
    cudnn.clear()
    for model in (WrittenOut(returns_probabilities=True), WrittenOut(axis=-2), WrittenOut(cap=30.0)):
        precision.with_policy(model, "mixed_bf16").apply(model.init(jax.random.key(1), x), x)
    assert not cudnn


def test_float32_attention_a_float32_rule_and_the_option_off_are_never_fused(cudnn):
    model = linen_gpt.GPT(VOCAB, T, WIDTH, HEADS, 2)
    assert [how for _, how in _report(model, _tokens(), policy="fp32")] == [
        "not fused: it computes in float32 (cuDNN's fused attention takes float16 or bfloat16)"] * 2
    ruled = precision.explain(model, _tokens(), policy="mixed_bf16", rules=[("block_0/attn", "f32")]).attention
    assert [how.startswith("not fused") for _, how in ruled] == [True, False]
    off = _report(model, _tokens(), ops=precision.op_lists(fuse_attention=False))
    assert all("fuse_attention=False" in how for _, how in off)
    cudnn.clear()
    variables = model.init(jax.random.key(1), _tokens())
    precision.with_policy(model, "fp32").apply(variables, _tokens())
    precision.with_policy(model, "mixed_bf16", ops=precision.op_lists(fuse_attention=False)).apply(
        variables, _tokens())
    assert not cudnn


@pytest.mark.skipif(any(importlib.util.find_spec(f"jax_cuda{v}_plugin") for v in (12, 13)),
                    reason="JAX's CUDA plugin is installed here: cuDNN's call can be described")
def test_without_cuda_nothing_is_fused_and_explain_says_why():
    explanation = precision.explain(linen_gpt.GPT(VOCAB, T, WIDTH, HEADS, 2), _tokens(), policy="mixed_bf16")
    assert explanation.attention and not explanation.fused_attention
    assert all("CUDA plugin" in how or "cannot take" in how for _, how in explanation.attention)


def test_op_lists_keep_the_fusion_choice_of_their_base():
    off = precision.op_lists(fuse_attention=False)
    assert not precision.op_lists(deny=["tanh"], base=off).fuse_attention
    assert precision.op_lists(fuse_attention=True, base=off).fuse_attention
    assert precision.op_lists().fuse_attention


def test_grouped_key_value_heads_reach_the_fused_call_unrepeated(cudnn, monkeypatch):
    # Hugging Face's Llama repeats its key/value heads to the query's (jnp.repeat) before the
    # attention; the fused call takes them grouped (query head n reads key head n // groups), so
    # a decode step reads its cache once, not the cache and a repeated copy of it.
    heads = []
    pretend = fused_attention._ORIGINAL
    monkeypatch.setattr(fused_attention, "_ORIGINAL", lambda **kw: heads.append(
        (kw["query"].shape[2], kw["key"].shape[2], kw["value"].shape[2])) or pretend(**kw))
    make, inputs = CASES["HF-style Llama with padding"]
    model, args = make(), inputs()
    variables = model.init(jax.random.key(1), *args)
    fused, unfused = _fused_and_unfused(model, variables, *args)
    assert heads and set(heads) == {(HEADS, 2, 2)}
    np.testing.assert_allclose(fused, unfused, atol=0.06, rtol=0.06)
