"""Fused attention for a TPU: the Pallas flash (or splash) attention in the TPU branch of every
attention autocast fuses, where it computes what the model computes.

The kernel runs here, on the CPU, in Pallas's TPU interpret mode, with the lowering made to take
the TPU branch; libtpu is stood in for (it is needed to compile for a TPU, not to trace the
kernel). The TPU programs themselves are checked in test_tpu_compile.
"""

import sys

import flax.linen as nn
import jax
import jax.ad_checkpoint
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

import precision
from helpers import ROOT
from precision.autocast import attention_fusion, higher_order, tpu_attention, tpu_flash

sys.path.insert(0, str(ROOT / "examples" / "user_models"))
import hf_style  # noqa: E402
import linen_gpt  # noqa: E402

VOCAB, T, WIDTH, HEADS = 32, 128, 32, 2  # the kernel's blocks are 128 long; few, for interpret mode's sake


@pytest.fixture
def libtpu(monkeypatch):
    """The TPU kernel described, as where libtpu is installed."""
    monkeypatch.setattr(tpu_attention, "available", lambda: True)


def _on(platform):
    def choose(*operands, default, **branches):
        return branches[platform](*operands) if platform in branches else default(*operands)
    return choose


def _tokens(seed=0, batch=1):
    return jax.random.randint(jax.random.key(seed), (batch, T), 0, VOCAB)


def _inputs():
    return jax.random.normal(jax.random.key(0), (1, T, WIDTH))


class NNAttention(nn.Module):
    """``jax.nn.dot_product_attention`` called by a model, causal or with a learned bias."""

    causal: bool = True
    with_bias: bool = False

    @nn.compact
    def __call__(self, x):
        q, k, v = (nn.DenseGeneral((HEADS, WIDTH // HEADS), name=n)(x) for n in ("q", "k", "v"))
        bias = self.param("bias", nn.initializers.normal(0.5), (1, HEADS, T, T)) if self.with_bias else None
        out = jax.nn.dot_product_attention(q, k, v, bias=bias, is_causal=self.causal)
        return nn.DenseGeneral(WIDTH, axis=(-2, -1), name="out")(out)


def _padding():
    return jnp.ones((2, T), jnp.int32).at[1, 100:].set(0)  # two rows: one padded


MODELS = {
    "Flax SelfAttention GPT (causal)": (lambda: linen_gpt.GPT(VOCAB, T, WIDTH, HEADS, 1), lambda: (_tokens(),)),
    "HF-style GPT-2, padding as a bias": (lambda: hf_style.GPT2(VOCAB, T, WIDTH, HEADS, 1),
                                          lambda: (_tokens(batch=2), _padding())),
    "HF-style Llama, grouped kv heads": (lambda: hf_style.Llama(VOCAB, T, WIDTH, HEADS, 1, 1), lambda: (_tokens(),)),
    "jax.nn.dot_product_attention, a learned bias": (lambda: NNAttention(causal=False, with_bias=True),
                                                     lambda: (_inputs(),)),
    "jax.nn.dot_product_attention, no mask": (lambda: NNAttention(causal=False), lambda: (_inputs(),)),
}


def _outputs_and_grads(model, variables, args, platform, devices=1):
    wrapped = precision.with_policy(model, "mixed_bf16")

    def loss(params):
        out = wrapped.apply({**variables, "params": params}, *args)
        return jnp.mean(out.astype(jnp.float32) ** 2), out

    with pytest.MonkeyPatch.context() as m, pltpu.force_tpu_interpret_mode():
        for module in (attention_fusion, higher_order):
            m.setattr(module, "platform_dependent", _on(platform))
        # One device: the kernel, in interpret mode; more: XLA's ops the primitive lowers for them.
        m.setattr(tpu_flash, "choose", lambda *a, kernel, fallback: (kernel if devices == 1 else fallback)(*a))
        (_, out), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(variables["params"])
    return np.asarray(out, np.float32), _flat(grads)


def _flat(tree):
    return np.concatenate([np.ravel(np.asarray(x, np.float32)) for x in jax.tree_util.tree_leaves(tree)])


#: Every model on one chip (the kernel, in interpret mode); one on a slice (XLA's ops instead; more
#: of them in test_the_primitive_lowers_xla_ops_...).
CASES = [(name, 1) for name in MODELS] + [("HF-style Llama, grouped kv heads", 8)]


@pytest.mark.parametrize("name,devices", CASES, ids=[f"{n}-{'one chip: the kernel' if d == 1 else 'a slice: XLA'}"
                                                     for n, d in CASES])
def test_lowered_for_a_tpu_attention_runs_the_pallas_kernel_with_the_unfused_numbers(libtpu, name, devices):
    make, inputs = MODELS[name]
    model, args = make(), inputs()
    variables = model.init(jax.random.key(1), *args)
    explanation = precision.explain(model, *args, policy="mixed_bf16")
    assert explanation.fused_attention and all("Pallas flash attention" in how for _, how in explanation.attention)

    fused, fused_grads = _outputs_and_grads(model, variables, args, "tpu", devices)
    unfused, unfused_grads = _outputs_and_grads(model, variables, args, "cpu")
    reference = np.asarray(jax.jit(model.apply)(variables, *args), np.float32)
    exact = _flat(jax.jit(jax.grad(lambda p: jnp.mean(model.apply({**variables, "params": p}, *args) ** 2)))(
        variables["params"]))
    # Within half precision of the unfused half attention, and no further from float32 than it.
    np.testing.assert_allclose(fused, unfused, atol=0.06, rtol=0.06)
    assert np.abs(fused - reference).max() <= 1.5 * np.abs(unfused - reference).max() + 1e-3
    assert np.linalg.norm(fused_grads - unfused_grads) <= 0.05 * np.linalg.norm(unfused_grads)
    assert np.linalg.norm(fused_grads - exact) <= 1.5 * np.linalg.norm(unfused_grads - exact) + 1e-6


@pytest.mark.parametrize("name,splash", [("Flax SelfAttention GPT (causal)", True),
                                         ("jax.nn.dot_product_attention, no mask", True),
                                         ("jax.nn.dot_product_attention, a learned bias", False)])
def test_an_attention_without_a_bias_runs_the_splash_kernel_and_one_with_a_bias_the_flash_kernel(libtpu, name,
                                                                                                  splash):
    """The splash kernel keeps one logsumexp per query where the flash kernel keeps its statistics
    repeated over 128 lanes (three 100 MB arrays a layer read by GPT-2 small's backward pass); it
    takes no bias, so a biased attention keeps the flash kernel."""
    make, inputs = MODELS[name]
    model, args = make(), inputs()
    variables = model.init(jax.random.key(1), *args)
    wrapped = precision.with_policy(model, "mixed_bf16")

    def loss(params):
        return jnp.mean(wrapped.apply({**variables, "params": params}, *args).astype(jnp.float32) ** 2)

    with pytest.MonkeyPatch.context() as m:
        for module in (attention_fusion, higher_order):
            m.setattr(module, "platform_dependent", _on("tpu"))
        m.setattr(tpu_flash, "choose", lambda *a, kernel, fallback: kernel(*a))
        traced = str(jax.make_jaxpr(jax.grad(loss))(variables["params"]))
    kernels = {n for n in ("splash_mha_fwd_residuals", "splash_mha_dq_no_residuals", "splash_mha_dkv_no_residuals")
               if n in traced}
    assert "pallas_call" in traced and kernels == (set() if not splash else {
        "splash_mha_fwd_residuals", "splash_mha_dq_no_residuals", "splash_mha_dkv_no_residuals"}), kernels


def test_the_tpu_branch_holds_the_kernel_and_every_other_platform_what_it_had(libtpu):
    """The Pallas kernel is in the program lowered for a TPU only: the CPU's numbers are those
    of fusion off, bit for bit."""
    model = linen_gpt.GPT(VOCAB, T, WIDTH, HEADS, 1)
    variables = model.init(jax.random.key(1), _tokens())
    wrapped = precision.with_policy(model, "mixed_bf16")
    text = jax.jit(wrapped.apply).lower(variables, _tokens()).as_text(dialect="hlo")
    assert "tpu_custom_call" not in text
    off = precision.with_policy(model, "mixed_bf16", ops=precision.op_lists(fuse_attention=False))
    assert np.array_equal(wrapped.apply(variables, _tokens()), off.apply(variables, _tokens()))
    traced = str(jax.make_jaxpr(lambda v: wrapped.apply(v, _tokens()))(variables))
    assert "precision_tpu_flash_attention" in traced


def test_what_the_tpu_kernel_would_compute_otherwise_stays_with_why(libtpu):
    short = precision.explain(linen_gpt.GPT(VOCAB, 16, WIDTH, HEADS, 1), _tokens()[:, :16], policy="mixed_bf16")
    assert all(how.count("Pallas") == 1 for _, how in short.attention)
    # "not fused: ..." where cuDNN's call cannot be described either, "...; not by ..." where it can
    assert all("Pallas flash attention for TPU: the TPU kernel cannot take its shapes" in how
               for _, how in short.attention)

    def call(**options):
        x = jnp.ones((2, T, HEADS, 8), jnp.bfloat16)
        return tpu_attention.flash_function(("query", "key", "value", *options.pop("names", ())),
                                            options, [x, x, x, *options.pop("arrays", ())])

    mask = jnp.ones((2, 1, T, T), bool)
    assert call(names=("mask",), arrays=(mask,))[1].startswith("its mask is not causal")
    assert call(local_window_size=(8, 0))[1].startswith("a local window")
    assert call(implementation="xla")[1] == "the model asked for implementation='xla'"
    kernel, why = call(is_causal=True, scale=0.5)
    assert kernel is not None and why == ""


def test_without_libtpu_nothing_of_the_tpu_kernel_is_traced_or_said(monkeypatch):
    monkeypatch.setattr(tpu_attention, "available", lambda: False)
    model = linen_gpt.GPT(VOCAB, T, WIDTH, HEADS, 1)
    explanation = precision.explain(model, _tokens(), policy="mixed_bf16")
    assert not any("Pallas" in how or "TPU" in how for _, how in explanation.attention)
    wrapped = precision.with_policy(model, "mixed_bf16")
    traced = str(jax.make_jaxpr(lambda v: wrapped.apply(v, _tokens()))(model.init(jax.random.key(1), _tokens())))
    assert "precision_tpu_flash_attention" not in traced


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "unmasked"])
def test_the_splash_kernel_over_several_blocks_computes_the_fallbacks_values_and_gradients(monkeypatch, causal):
    """Four blocks of 128 along queries and keys (the block tables of a causal mask skip those
    above the diagonal), a scale that is not a power of two: the splash kernel's output, softmax
    statistics and gradients (interpret mode) are the XLA fallback's, within bfloat16's rounding."""
    from precision.autocast import tpu_splash

    monkeypatch.setattr(tpu_splash, "BLOCK", 128)
    tpu_splash._kernel.cache_clear()
    length, scale = 512, 0.3
    q, k, v, do = (jax.random.normal(jax.random.key(i), (1, 2, length, 16), jnp.bfloat16) for i in range(4))
    with pltpu.force_tpu_interpret_mode():
        out, l, m = tpu_splash.forward(causal, scale, q, k, v)
        grads = tpu_splash.backward(causal, scale, q, k, v, out, l, m, do)
    tpu_splash._kernel.cache_clear()
    want_out, want_l, want_m = tpu_flash._xla_fwd(causal, scale, False, q, k, v)
    want_grads = tpu_flash._xla_bwd(causal, scale, False, q, k, v, want_out, want_l, want_m, do)
    np.testing.assert_allclose(np.float32(out), np.float32(want_out), atol=0.02)
    np.testing.assert_allclose(np.asarray(m + jnp.log(l)), np.asarray(want_m + jnp.log(want_l)), atol=0.02)
    for got, want in zip(grads, want_grads, strict=True):
        assert np.linalg.norm(np.float32(got) - np.float32(want)) <= 0.02 * np.linalg.norm(np.float32(want))


def test_the_primitive_lowers_xla_ops_for_a_program_on_several_devices_eagerly_and_under_vmap(monkeypatch):
    """Where the lowering is for more than one device (here pretended), the pass is XLA's ops:
    the same numbers as the kernel's computation written out, eagerly, under jit and vmap."""
    monkeypatch.setattr(tpu_flash, "_devices", lambda ctx: 2)
    q, k, v = (jax.random.normal(jax.random.key(i), (3, 2, HEADS, T, 8), jnp.bfloat16) for i in range(3))

    def reference(q, k, v):
        return jax.nn.dot_product_attention(*(jnp.swapaxes(x, 1, 2) for x in (q, k, v)), is_causal=True,
                                            scale=0.5).swapaxes(1, 2)

    def flash(q, k, v):
        return tpu_flash.flash(q, k, v, None, causal=True, scale=0.5)

    want = jax.vmap(reference)(q, k, v).astype(jnp.float32)
    for got in (jax.vmap(flash)(q, k, v), jax.jit(jax.vmap(flash))(q, k, v), flash(q[0], k[0], v[0])[None]):
        np.testing.assert_allclose(np.asarray(got, np.float32), want[:len(got)], atol=0.02)
    grads = jax.grad(lambda *a: jnp.sum(flash(*a).astype(jnp.float32) ** 2), (0, 1, 2))(q[0], k[0], v[0])
    expected = jax.grad(lambda *a: jnp.sum(reference(*a).astype(jnp.float32) ** 2), (0, 1, 2))(q[0], k[0], v[0])
    for g, e in zip(grads, expected):
        assert np.linalg.norm(np.float32(g) - np.float32(e)) <= 0.02 * np.linalg.norm(np.float32(e))


def _saved(model, variables, args, capsys):
    """The residuals a mixed_bf16 step keeps for its backward pass, as ``bf16[1,128,2,16]``."""
    wrapped = precision.with_policy(model, "mixed_bf16")
    loss = lambda params: jnp.sum(wrapped.apply({**variables, "params": params}, *args).astype(jnp.float32))  # noqa: E731
    jax.ad_checkpoint.print_saved_residuals(loss, variables["params"])
    return sorted(line.split()[0] for line in capsys.readouterr().out.splitlines() if " from the argument" not in line)


def test_the_tpu_branch_keeps_the_residuals_the_other_platforms_keep(libtpu, monkeypatch, capsys):
    """A program holds every platform's attention, and keeps the residuals of each (a ``cond``'s
    branches share only residuals of one shape and dtype): the TPU kernel's are kept in jax.nn's
    layout, as cuDNN's and XLA's are, not transposed to its own (benchmarks/suite's memory_ratio:
    0.676 with them, 0.635 without)."""
    model = linen_gpt.GPT(VOCAB, T, WIDTH, HEADS, 1)
    variables = model.init(jax.random.key(1), _tokens())
    with_tpu = _saved(model, variables, (_tokens(),), capsys)
    monkeypatch.setattr(tpu_attention, "available", lambda: False)
    without = _saved(model, variables, (_tokens(),), capsys)
    assert f"bf16[1,{HEADS},{T},{WIDTH // HEADS}]" not in with_tpu, with_tpu  # heads first: the kernel's layout
    if not attention_fusion._cuda_plugin():  # no cuDNN branch here: XLA's alone keeps other residuals than the kernel
        pytest.skip("the slots the TPU kernel shares are the cuDNN branch's: needs JAX's CUDA plugin "
                    "(pip install '.[gpu-compile]'); the layout is checked above")
    added = list(with_tpu)
    for r in without:
        if r in added:
            added.remove(r)
    assert added in ([], [f"f32[1,{HEADS},{T}]"]), added  # at most the kernel's softmax maximum
