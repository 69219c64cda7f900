"""A Llama's decode step in five fused kernels a layer (``--decode-kernels fused``).

On this CPU the Pallas kernels run interpreted: the same program a GPU runs as Triton
kernels, checked here against the model's own step (its modules, compiled by XLA).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks.serving import llama_source
from train.serving import Generator, SampleError, Sampling
from train.serving.fused_decode import fused_decoder, fused_refusal

SHAPE = {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2,
         "vocab_size": 512, "max_position_embeddings": 128, "rope_theta": 10000.0, "rms_norm_eps": 1e-5,
         "tie_word_embeddings": False}
PROMPT = [1, 5, 9, 33, 2, 7, 100, 64, 3]


@pytest.fixture(scope="module")
def llama():
    return llama_source(2, SHAPE["vocab_size"], SHAPE)


def _cast(tree):
    return jax.tree_util.tree_map(lambda x: np.asarray(x, np.float32), tree)


@pytest.mark.parametrize("dtype, tolerance", [("f32", 1e-5), ("bf16", 2e-2), ("int8", 2e-2)])
def test_the_fused_step_computes_the_models_own_step_and_writes_its_cache(llama, dtype, tolerance):
    generator = Generator(llama, dtype)
    plain = generator.decoder
    fused = fused_decoder(plain, generator.model)
    cache = plain.init(1, 32)
    logits, cache = jax.jit(plain.forward)(generator.params, cache, jnp.asarray([PROMPT]), jnp.int32(0))
    token = jnp.argmax(logits[:, -1:], -1).astype(jnp.int32)
    index = jnp.int32(len(PROMPT))
    want, want_cache = jax.jit(plain.forward)(generator.params, cache, token, index)
    got, got_cache = jax.jit(fused.forward)(generator.params, cache, token, index)
    assert got.shape == want.shape == (1, 1, SHAPE["vocab_size"]) and got.dtype == jnp.float32
    np.testing.assert_allclose(got, want, atol=tolerance * float(jnp.max(jnp.abs(want))))
    assert int(jnp.argmax(got)) == int(jnp.argmax(want))
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(_cast(want_cache)),
                            jax.tree_util.tree_leaves(_cast(got_cache))):
        np.testing.assert_allclose(b, a, atol=tolerance * max(1.0, float(np.max(np.abs(a)))),
                                   err_msg=jax.tree_util.keystr(path))
    layer = got_cache["model"]["layers"]["1"]["self_attn"]
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


def test_a_gpt2_is_not_taken_by_the_llama_kernels():
    from train.serving.fused_decode import fused_refusal as refusal

    class Config:
        model_type = "gpt2"

    class Module:
        config = Config()

    assert "Llama-family" in refusal(Module(), {})


@pytest.mark.gpu_compile
def test_on_an_h100_a_layer_is_five_triton_kernels_reading_its_weights_and_cache_once(llama):
    pytest.importorskip("jax_plugins.xla_cuda12")
    from train.serving.compiled import compile_decode_step

    xla = compile_decode_step(Generator(llama, "bf16"), "h100", length=128)
    fused = compile_decode_step(Generator(llama, "bf16", decode_kernels="fused"), "h100", length=128)
    kernels = [m.kernel for m in fused.modeled.kernels]
    triton = [k for k in kernels if k.name.startswith("pallas_call")]
    assert len(triton) == 5 * 2 + 1  # five a layer, and the head
    assert not [k for k in kernels if k.kind == "copy"]  # the stored (out, in) weights read as they are
    assert len(kernels) <= 5 * 2 + 8 < xla.modeled.launches
    # every weight and the cache once: the attention updates the cache in place (its aliased results
    # are not bytes moved again)
    assert fused.bytes <= fused.modeled.bytes < fused.bytes + fused.cache_bytes  # counted twice: past it
    assert fused.modeled.seconds < xla.modeled.seconds
