"""Serving (issue 70): ``python -m train sample`` and ``train.generate`` decode with a KV cache
(this project's GPT, a Flax ``decode=True`` model, Hugging Face GPT-2) to the same tokens as
without one, one compiled step for every token, weights in bf16/f16/int8 with the float32
islands kept, a cache in int8/fp8, bad input refused in one line."""

import functools
import io

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import traverse_util

import train
from serving_models import VOCAB, decoding_source, gpt_source, huggingface_gpt2
from train.cli import main
from train.serving import Generator, SampleError, Sampling, load_source
from train.serving.kv_store import QuantizedKV
from train.serving.layout import is_stored_weight, read_weight
from train.serving.sampling import next_tokens

GREEDY = Sampling(temperature=0)
SOURCE = gpt_source()  # the tests' GPT: its generators (and their compiled programs) are shared


@functools.cache
def _served(dtype="f32", kv=None, cache=True):
    """A generator of ``SOURCE``, made once per (dtype, kv, cache) for all the tests."""
    return Generator(SOURCE, dtype, kv, cache=cache)


def _greedy(source, tokens=12, cache=True, dtype="f32", kv=None, prompt="ROMEO:"):
    return Generator(source, dtype, kv, cache=cache).generate(prompt, tokens, GREEDY).tokens


@pytest.mark.parametrize("make", [lambda: SOURCE, lambda: gpt_source(scan_layers=True, remat="full"),
                                  decoding_source], ids=["gpt", "gpt-scanned", "flax-decode"])
def test_cached_and_uncached_greedy_decoding_give_the_same_tokens(make):
    source = make()
    pair = (_served(), _served(cache=False)) if source is SOURCE else (Generator(source, "f32"),
                                                                        Generator(source, "f32", cache=False))
    with_cache, without = pair
    assert with_cache.decoder.cached and not without.decoder.cached
    np.testing.assert_array_equal(with_cache.generate("ROMEO:", 12, GREEDY).tokens,
                                  without.generate("ROMEO:", 12, GREEDY).tokens)


def test_the_decode_step_compiles_once_whatever_the_number_of_tokens():
    compiles = []
    listener = lambda event, seconds, **kw: compiles.append(event)  # noqa: E731
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        generator = Generator(gpt_source(block_size=32), "bf16")
        generator.generate("ROMEO:", 40, Sampling(seed=1))  # the prefill, the step, the chunk, the slid prefill
        first = compiles.count("/jax/core/compile/backend_compile_duration")
        out = generator.generate("ROMEO:", 160, Sampling(seed=2))  # four times the tokens, eight slides
        again = compiles.count("/jax/core/compile/backend_compile_duration") - first
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert again == 0 and out.slides == 8 and out.tokens.shape == (1, 160)
    assert sorted(k[0] for k in generator._programs) == ["chunk", "prefill", "prefill", "step"]


@pytest.mark.parametrize("make", [lambda: gpt_source(block_size=32), decoding_source], ids=["gpt", "flax-decode"])
def test_tokens_decoded_a_chunk_a_dispatch_are_the_tokens_decoded_one_at_a_time(make, monkeypatch):
    """The chunk program scans the step on the device: sampled tokens, keyed by position, are the
    same bit for bit, across the window's slides too (a Flax ``decode`` model through its own
    cache collection as well)."""
    import train.serving.generation as generation
    generator = Generator(make(), "f32")
    chunked = generator.generate("ROMEO:", 70, Sampling(temperature=1.0, top_k=20, seed=3))
    monkeypatch.setattr(generation, "DECODE_CHUNK", 10 ** 9)
    single = generator.generate("ROMEO:", 70, Sampling(temperature=1.0, top_k=20, seed=3))
    assert chunked.slides == single.slides == 3 and "chunk" in [k[0] for k in generator._programs]
    np.testing.assert_array_equal(chunked.tokens, single.tokens)


WINDOWS = np.random.default_rng(0).integers(0, len(VOCAB), (4, 32))


def _agreement(generator, reference):
    """The share of positions whose greedy token (teacher-forced) is ``reference``'s."""
    return np.mean(generator.logits(WINDOWS).argmax(-1) == reference.logits(WINDOWS).argmax(-1))


def test_half_and_int8_weights_keep_the_norms_in_float32_and_follow_float32():
    reference = _served()
    for dtype in ("bf16", "f16", "int8"):
        generator = _served(dtype)
        flat = traverse_util.flatten_dict(generator.served.params, is_leaf=lambda k, x: is_stored_weight(x))
        assert flat[("ln_f", "scale")].dtype == jnp.float32  # the run's rule: LayerNorm -> f32
        half = flat[("block_0", "attn", "qkv", "bias")].dtype
        assert half == (jnp.float16 if dtype == "f16" else jnp.bfloat16)
        if dtype == "int8":
            kernel = flat[("block_0", "Dense_0", "kernel")]  # (32, 128): a scale per output column,
            assert kernel.order == (1, 0)  # stored (out, in): its contracted axis last
            assert kernel.stored.codes.dtype == jnp.int8 and kernel.stored.scales.shape == (128, 1)
            np.testing.assert_array_equal(read_weight(kernel, jnp.float32).shape, (32, 128))
            assert generator.served.bytes < _served("bf16").served.bytes
        agree = _agreement(generator, reference)
        assert agree >= 0.9, (dtype, agree)


def test_an_int8_or_fp8_cache_holds_each_head_and_position_to_its_rounding():
    new = jax.random.normal(jax.random.key(0), (2, 3, 4, 16)) * jnp.arange(1, 5)[None, None, :, None]
    for code, rounding in (("int8", 1 / 254), ("fp8", 2 ** -4)):
        store = QuantizedKV(code)
        stored = store.write(store.init((2, 8, 4, 16), jnp.float32), new, jnp.int32(2))
        back = store.read(stored, jnp.float32)
        assert stored["scales"].shape == (2, 8, 4, 1) and not back[:, :2].any() and not back[:, 5:].any()
        peak = jnp.max(jnp.abs(new), axis=-1, keepdims=True)
        assert float(jnp.max(jnp.abs(back[:, 2:5] - new) / peak)) <= rounding
    for kv in ("int8", "fp8"):
        assert _agreement(_served("bf16", kv), _served("bf16")) >= 0.9


def test_sampling_keeps_the_top_k_and_the_nucleus_in_float32():
    logits = jnp.log(jnp.asarray([[0.5, 0.3, 0.15, 0.05]]))
    draws = lambda s: {int(next_tokens(logits, jax.random.key(i), s)[0]) for i in range(200)}  # noqa: E731
    assert draws(Sampling(top_k=2)) == {0, 1}
    assert draws(Sampling(top_p=0.7)) == {0, 1}  # 0.5 + 0.3 reach 0.7
    assert draws(Sampling(top_p=0.5)) == {0}
    assert draws(Sampling()) == {0, 1, 2, 3}
    assert int(next_tokens(logits.astype(jnp.bfloat16), jax.random.key(0), GREEDY)[0]) == 0


def test_bad_input_is_one_line_exit_2(tmp_path, capsys):
    with pytest.raises(SampleError, match=r"outside the model's vocabulary \('Z'; the first at position 3\)"):
        _served("bf16").generate("ROMZEO", 4)
    with pytest.raises(SampleError, match="pass the model's context of 32 positions .* give --tokens 26 or fewer"):
        _served("bf16").generate("ROMEO:", 40, window=False)
    with pytest.raises(SampleError, match="--dtype .int4.: give bf16, f16, f32, int8 or nf4"):
        Generator(SOURCE, "int4")
    with pytest.raises(SampleError, match="--kv-dtype 'int4'"):
        Generator(SOURCE, "bf16", "int4")
    assert main(["sample", str(tmp_path / "nowhere")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is not a run, an export or a Hugging Face directory: it does not exist" in err


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    from helpers import flax_transformers

    return huggingface_gpt2(tmp_path_factory.mktemp("gpt2"), flax_transformers())


def test_a_hugging_face_gpt2_samples_through_the_command_with_its_cache(hf_dir, capsys):
    assert main(["sample", str(hf_dir), "--prompt", "ROMEO : the king", "--tokens", "6", "--temperature", "0"]) == 0
    text, end = capsys.readouterr().out.strip().splitlines()[-2:]
    assert text.startswith("ROMEO : the king") and len(text.split()) == 10
    assert "KV cache (the Hugging Face model's own) in bf16" in end and "tokens/s" in end
    source = load_source(str(hf_dir))
    uncached = _greedy(source, tokens=6, cache=False, prompt="ROMEO : the king")
    np.testing.assert_array_equal(_greedy(source, tokens=6, prompt="ROMEO : the king"), uncached)
    assert main(["sample", str(hf_dir), "--prompt", "ROMEO : Tybalt"]) == 2
    assert "cannot encode" in capsys.readouterr().err
    fused = ["sample", str(hf_dir), "--prompt", "ROMEO : the king", "--tokens", "6", "--temperature", "0",
             "--decode-kernels", "fused"]
    assert main(fused) == 0  # the same tokens through the fused kernels (interpreted here)
    fused_text, fused_end = capsys.readouterr().out.strip().splitlines()[-2:]
    assert fused_text == text and "each token in fused kernels" in fused_end
    with pytest.raises(SampleError, match="--decode-kernels fused: the fused decode kernels are written for Hugging "
                                          "Face gpt2, llama, mistral models; GPT is not one"):
        Generator(SOURCE, "bf16", decode_kernels="fused")


def test_an_exported_lora_fine_tune_of_it_samples_through_the_command(hf_dir, tmp_path, capsys):
    text = {"name": "synthetic_text", "num_classes": 21, "seq_len": 16, "batch_size": 4, "num_train": 2000,
            "num_test": 200, "eval_batch_size": 8, "eval_batches": 1}
    config = train.config.from_dict({
        "steps": 1, "progress": False, "inference_dtypes": [], "checkpoint_every": 0, "workdir": str(tmp_path / "run"),
        "model": {"name": "train.weights.huggingface:model", "path": str(hf_dir), "init_from": str(hf_dir),
                  "output": "logits"},
        "data": text, "finetune": {"lora": {"rank": 2}}, "optimizer": {"lr": 1e-2}})
    train.run(config, out=io.StringIO())
    assert main(["export", str(tmp_path / "run"), "--dtype", "bf16", str(tmp_path / "out")]) == 0
    capsys.readouterr()
    assert main(["sample", str(tmp_path / "out"), "--prompt", "JULIET :", "--tokens", "4", "--dtype", "int8"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-2].startswith("JULIET :") and "int8; weights" in out[-1]
    assert "KV cache (the Hugging Face model's own)" in out[-1]


def test_the_doctor_names_what_overflows_only_when_decoding_in_float16_and_its_verified_fix():
    from train.serving.diagnose import diagnose_decoding, format_diagnosis

    source = gpt_source(amplify=5e4)  # its keys pass float16's range (bfloat16's, never: the fix verified)
    found = diagnose_decoding(Generator(source, "f16"), "ROMEO:")
    problem = found["prefill"].problems[0]
    assert (problem.kind, problem.path, problem.op) == ("overflow", "block_0/attn/qkv", "dot_general")
    assert found["prefill"].recommendations and found["decode step"] is None
    assert "doctor, prefill: dot_general in block_0/attn/qkv (forward) first went non-finite; verified fix" in \
        format_diagnosis(found)
    assert "decode step: not diagnosed: the served prefill left non-finite values" in format_diagnosis(found)


@pytest.mark.gpu_compile
def test_the_h100_decode_step_reads_weights_and_cache_once_in_their_dtypes():
    # Hugging Face's Flax Llama, grouped key/value heads (8 query, 2 kv): its H100 decode step
    # moved 1.16x (bf16) and 1.32x (int8) the bytes a token reads where int8 weights were
    # dequantized into a bfloat16 copy and the cache repeated to the query heads; now ~1.0x.
    from benchmarks.serving import LLAMA3_8B, llama_source
    from helpers import needs_cuda_plugin
    from train.serving.compiled import compile_decode_step

    needs_cuda_plugin()
    shape = LLAMA3_8B | {"hidden_size": 512, "intermediate_size": 1536, "num_attention_heads": 8,
                         "num_key_value_heads": 2, "max_position_embeddings": 256}
    generators = [Generator(llama_source(1, 512, shape), "bf16")]
    generators.append(Generator(generators[0].source, "int8"))
    half, int8 = map(compile_decode_step, generators)
    assert half.modeled.bytes < 1.03 * half.bytes and int8.modeled.bytes < 1.05 * int8.bytes
    assert int8.weight_bytes < 0.55 * half.weight_bytes and int8.modeled.bytes < 0.6 * half.modeled.bytes
    assert "decode step on h100" in half.line() and half.length == 256 and half.ratio > 1
    # its attention: cuDNN's fused forward kernel (serving is never differentiated)
    assert sum(m.kernel.launches for m in half.modeled.kernels if m.kernel.kind == "attention") == 1
    # the bytes a token reads count one row of each embedding only looked up
    assert half.weight_bytes < generators[0].served.bytes
    # this project's GPT with int8 weights and an int8 cache: the cache read as its codes and scales
    generator = Generator(gpt_source(d_model=128), "int8", "int8")  # its 128 x 384... kernels in int8
    codes = compile_decode_step(generator)
    cache = jax.eval_shape(lambda: generator.decoder.init(1, codes.length))
    values = sum(x.size for x in jax.tree_util.tree_leaves(cache) if x.dtype == jnp.int8)
    assert codes.cache_bytes < 0.6 * 2 * values and codes.modeled.bytes < 1.3 * codes.bytes


def test_a_token_reads_one_row_of_a_table_only_looked_up_and_all_of_a_tied_one():
    from precision.contractions import contracted_axes

    ids = jnp.asarray([1, 2])
    tree = {"tied": jnp.ones((8, 4)), "table": jnp.ones((8, 4)), "w": jnp.ones((4, 3))}
    axes = contracted_axes(lambda p: p["tied"][ids] @ p["tied"].T + (p["table"][ids] @ p["w"]).sum(), tree,
                           matmuls=False)
    assert axes == {"tied": None, "table": (1,), "w": None}
    served = _served("bf16").served
    assert served.looked_up == {("tokens", "embedding"), ("positions", "embedding")}
    tables = sum(int(np.size(x)) * 2 for x in (SOURCE.params["tokens"]["embedding"],
                                               SOURCE.params["positions"]["embedding"]))
    assert served.token_bytes == served.bytes - tables + 2 * 2 * SOURCE.params["tokens"]["embedding"].shape[1]


def test_a_vocabulary_without_a_newline_is_prompted_with_its_first_character_and_says_it_has_no_whitespace():
    from train.serving import SampleError
    from train.serving.tokenizer import CharTokenizer

    synthetic, plays = CharTokenizer("ĀāĂă"), CharTokenizer("\n !ABab")
    assert (synthetic.default_prompt, plays.default_prompt) == ("Ā", "\n")
    with pytest.raises(SampleError, match=r"\('\\n', 'x'; the first at position 1\); it knows 4 characters: "
                                          r"'ĀāĂă' \(no whitespace\)$"):
        synthetic.encode("Āx\n")
    with pytest.raises(SampleError, match=r"it knows 7 characters: '!ABab' and the whitespace '\\n '$"):
        plays.encode("é")
