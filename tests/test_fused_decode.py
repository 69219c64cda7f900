"""A decode step in five fused kernels a layer (``--decode-kernels fused``): Llama and GPT-2.

On this CPU the Pallas kernels run interpreted: the same program a GPU runs as Triton
kernels, checked here against the model's own step (its modules, compiled by XLA).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks.serving import gpt2_source, llama_source
from train.serving import Generator, SampleError, Sampling
from train.serving.fused_decode import fused_decoder, fused_refusal

SHAPE = {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2,
         "vocab_size": 512, "max_position_embeddings": 128, "rope_theta": 10000.0, "rms_norm_eps": 1e-5,
         "tie_word_embeddings": False}
#: 192 wide (not a power of two: the norms read a row in blocks), a vocabulary no block divides
GPT2_SHAPE = {"n_embd": 192, "n_layer": 2, "n_head": 3, "vocab_size": 500, "n_positions": 64}
PROMPT = [1, 5, 9, 33, 2, 7, 100, 64, 3]


@pytest.fixture(scope="module")
def llama():
    return llama_source(2, SHAPE["vocab_size"], SHAPE)


def _sharpened(source, factor=4.0):
    """``source`` with its kernels ``factor`` times larger: peaked attention and logits, not the
    near-uniform ones of a fresh initialization."""
    return source._replace(params=jax.tree_util.tree_map_with_path(
        lambda path, x: x * factor if "kernel" in jax.tree_util.keystr(path) else x, source.params))


@pytest.fixture(scope="module")
def gpt2():
    return _sharpened(gpt2_source(GPT2_SHAPE))


@pytest.fixture(scope="module")
def gpt2_untied():
    return _sharpened(gpt2_source(GPT2_SHAPE | {"tie_word_embeddings": False}))


def _cast(tree):
    return jax.tree_util.tree_map(lambda x: np.asarray(x, np.float32), tree)


@pytest.mark.parametrize("family, dtype, tolerance", [
    ("llama", "f32", 1e-5), ("llama", "bf16", 2e-2), ("llama", "int8", 2e-2),
    ("gpt2", "f32", 1e-5), ("gpt2", "bf16", 2e-2), ("gpt2_untied", "int8", 2e-2)])
def test_the_fused_step_computes_the_models_own_step_and_writes_its_cache(request, family, dtype, tolerance):
    generator = Generator(request.getfixturevalue(family), dtype)
    plain = generator.decoder
    fused = fused_decoder(plain, generator.model)
    cache = plain.init(1, 32)
    logits, cache = jax.jit(plain.forward)(generator.params, cache, jnp.asarray([PROMPT]), jnp.int32(0))
    token = jnp.argmax(logits[:, -1:], -1).astype(jnp.int32)
    index = jnp.int32(len(PROMPT))
    want, want_cache = jax.jit(plain.forward)(generator.params, cache, token, index)
    got, got_cache = jax.jit(fused.forward)(generator.params, cache, token, index)
    assert got.shape == want.shape == (1, 1, generator.model.config.vocab_size) and got.dtype == jnp.float32
    np.testing.assert_allclose(got, want, atol=tolerance * float(jnp.max(jnp.abs(want))))
    assert int(jnp.argmax(got)) == int(jnp.argmax(want))
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(_cast(want_cache)),
                            jax.tree_util.tree_leaves(_cast(got_cache))):
        np.testing.assert_allclose(b, a, atol=tolerance * max(1.0, float(np.max(np.abs(a)))),
                                   err_msg=jax.tree_util.keystr(path))
    layers = got_cache["model"]["layers"] if "model" in got_cache else got_cache["transformer"]["h"]
    layer = next(iter(layers["1"].values()))
    assert int(layer["cache_index"]) == len(PROMPT) + 1
    assert float(jnp.max(jnp.abs(layer["cached_key"][0, len(PROMPT)]))) > 0  # the new key, written in place
    assert float(jnp.max(jnp.abs(layer["cached_key"][0, len(PROMPT) + 1:]))) == 0


def test_generation_with_fused_kernels_gives_the_models_greedy_tokens_and_says_so(llama):
    greedy = Sampling(temperature=0)
    want = Generator(llama, "bf16").generate(PROMPT, 18, greedy)  # past the first chunk of 16
    fused = Generator(llama, "bf16", decode_kernels="fused")
    got = fused.generate(PROMPT, 18, greedy)
    np.testing.assert_array_equal(got.tokens, want.tokens)
    assert "each token in fused kernels" in got.end_line()
    two = fused.generate(PROMPT, 3, greedy, batch=2)  # rows of their own in the attention's grid
    np.testing.assert_array_equal(two.tokens, np.repeat(want.tokens[:, :3], 2, axis=0))
    odd = fused.generate(PROMPT, 2, greedy, batch=3)  # not a power of two: the model's own step
    np.testing.assert_array_equal(odd.tokens[0], want.tokens[0, :2])
    assert "each token not fused (" in odd.end_line() and "batch 3" in odd.end_line()


def test_what_the_fused_kernels_cannot_take_is_refused_in_one_line(llama):
    tied = llama_source(1, SHAPE["vocab_size"], SHAPE | {"tie_word_embeddings": True})
    with pytest.raises(SampleError, match="--decode-kernels fused: .*untied head"):
        Generator(tied, "bf16", decode_kernels="fused")
    with pytest.raises(SampleError, match="--decode-kernels fused: .*no KV cache"):
        Generator(llama, "bf16", cache=False, decode_kernels="fused")
    with pytest.raises(SampleError, match="--decode-kernels tpu: give one of xla, fused"):
        Generator(llama, "bf16", decode_kernels="tpu")
    generator = Generator(llama, "bf16")
    assert fused_refusal(generator.model, generator.served.params) is None
    assert "batch 3" in fused_refusal(generator.model, generator.served.params, 3)


def test_models_of_other_families_and_layers_the_kernels_do_not_do_are_refused_by_name():
    class Config:
        model_type, activation_function = "gptj", "gelu_new"

    class Module:
        config = Config()

    assert "written for Hugging Face gpt2, llama, mistral models; Module is not one" in fused_refusal(Module(), {})
    Config.model_type, Config.activation_function = "gpt2", "relu"
    assert "GELU's tanh approximation (gelu_new, gelu_pytorch_tanh), not relu" in fused_refusal(Module(), {})


@pytest.mark.gpu_compile
@pytest.mark.parametrize("family, heads", [("llama", 1), ("gpt2", 0)])  # GPT-2's head: XLA's
def test_on_an_h100_a_layer_is_five_triton_kernels_reading_its_weights_and_cache_once(request, family, heads):
    pytest.importorskip("jax_plugins.xla_cuda12")
    from train.serving.compiled import compile_decode_step

    source = request.getfixturevalue(family)
    xla = compile_decode_step(Generator(source, "bf16"), "h100", length=64)
    fused = compile_decode_step(Generator(source, "bf16", decode_kernels="fused"), "h100", length=64)
    kernels = [m.kernel for m in fused.modeled.kernels]
    triton = [k for k in kernels if k.name.startswith("pallas_call")]
    assert len(triton) == 5 * 2 + heads  # five a layer
    assert not [k for k in kernels if k.kind == "copy"]  # the stored (out, in) weights read as they are
    assert len(kernels) <= 5 * 2 + 8 < xla.modeled.launches
    # every weight and the cache once: the attention updates the cache in place (its aliased results
    # are not bytes moved again)
    assert fused.bytes <= fused.modeled.bytes < fused.bytes + fused.cache_bytes  # counted twice: past it
    assert fused.modeled.seconds < xla.modeled.seconds
