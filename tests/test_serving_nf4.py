"""Serving a QLoRA run as it stored its weights (issue 70): ``--dtype nf4`` keeps the base's
NormalFloat4 codes and block scales as the checkpoint holds them, applies the LoRA adapters
unmerged, and decodes to what the trained model computes."""

import io

import jax

import numpy as np
import pytest
from flax import traverse_util

import train
from helpers import TINY_TEXT
from precision.block_codes import BlockCodes, dequantize_blocks
from precision.quantized_weights import dequantize_weight
from train.cli import main
from train.serving import Generator, SampleError, Sampling, load_source
from train.serving.layout import read_weight
from train.serving.weights import tree_bytes

GREEDY = Sampling(temperature=0)
#: a GPT whose matrices (64 x 192, 64 x 64, 64 x 256, 256 x 64) are large enough to be stored in codes
MODEL = {"name": "gpt", "num_layers": 2, "num_heads": 2, "d_model": 64}


def _train(workdir, text, **sections):
    config = train.config.from_dict({
        "workdir": str(workdir), "steps": 40, "progress": False, "inference_dtypes": [], "checkpoint_every": 40,
        "eval_every": 0, "model": MODEL, "optimizer": {"lr": 3e-3, "warmup_steps": 0},
        "data": {"name": "shakespeare", "path": str(text), "seq_len": 32, "batch_size": 8, "eval_batch_size": 8,
                 "eval_batches": 2}, **sections})
    train.run(config, out=io.StringIO())
    return workdir


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A GPT trained on a tiny text, and a QLoRA fine-tuning of it (rank 4 on an nf4 base)."""
    root = tmp_path_factory.mktemp("nf4")
    (root / "plays.txt").write_text(TINY_TEXT)
    base = _train(root / "base", root / "plays.txt")
    qlora = _train(root / "qlora", root / "plays.txt", finetune={"lora": {"rank": 4}, "base": "nf4"},
                   model=MODEL | {"init_from": str(base)}, optimizer={"lr": 3e-2, "warmup_steps": 0})
    return base, qlora


def test_the_base_is_served_in_the_codes_the_checkpoint_holds(runs):
    source = load_source(runs[1])
    generator = Generator(source, "nf4")
    served = traverse_util.flatten_dict(generator.served.params, is_leaf=lambda _, x: hasattr(x, "code"))
    stored = source.base.codes
    assert len(stored) == 8 and all(q.code == "nf4" for q in stored.values())  # qkv, proj, MLP: two blocks
    for path, q in stored.items():
        laid = served[path]  # laid out for decoding: the same codes and scales, reordered
        assert isinstance(laid, BlockCodes) and laid.code == "nf4" and laid.dtype == np.dtype("bfloat16")
        np.testing.assert_array_equal(np.sort(np.asarray(laid.codes), None), np.sort(np.asarray(q.codes), None))
        np.testing.assert_array_equal(np.asarray(dequantize_blocks(laid, np.float32)),
                                      np.asarray(dequantize_weight(q)))  # bit for bit
    # the adapters unmerged, beside each adapted kernel, trained (B is no longer zero)
    adapters = [p for p in served if str(p[-1]).endswith("_lora_b")]
    assert len(adapters) == source.base.adapters >= 8
    assert all(np.abs(np.asarray(read_weight(served[p]), np.float32)).max() > 0 for p in adapters)
    assert "8 in nf4 codes as stored (a scale per 64 values)" in generator.served.describe()
    assert tree_bytes(generator.params) < 0.5 * tree_bytes(Generator(source, "bf16").params)


def test_nf4_decodes_what_the_fine_tuned_model_computes_adapters_and_all(runs):
    source = load_source(runs[1])
    windows = np.asarray(next(iter(source.data.eval_batches(4, 1)))["inputs"])
    nf4, f32, bf16 = (Generator(source, d).logits(windows) for d in ("nf4", "f32", "bf16"))
    # without the adapters: the base alone, its codes read back (what merging would have to keep)
    unadapted = Generator(source._replace(params=_without_adapters(source)), "f32").logits(windows)
    error, effect = np.abs(nf4 - f32).max(), np.abs(unadapted - f32).max()
    assert error < 0.05 * effect and error < 2 * np.abs(bf16 - f32).max() + 1e-2  # 0.07, 5.4, 0.05
    assert np.mean(nf4.argmax(-1) == f32.argmax(-1)) > 0.97
    with_cache, without = Generator(source, "nf4"), Generator(source, "nf4", cache=False)
    np.testing.assert_array_equal(with_cache.generate("To be", 12, GREEDY).tokens,
                                  without.generate("To be", 12, GREEDY).tokens)


def _without_adapters(source):
    """``source``'s merged float32 weights with each adapted kernel as its codes give it back (no update)."""
    flat, stored = traverse_util.flatten_dict(source.params), traverse_util.flatten_dict(source.base.params)
    return traverse_util.unflatten_dict(flat | {path: stored[path] for path in source.base.codes})


def test_sample_prints_nf4_text_and_refuses_nf4_for_weights_without_codes(runs, capsys):
    assert main(["sample", str(runs[1]), "--prompt", "To be", "--tokens", "8", "--dtype", "nf4"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-2].startswith("To be") and "; nf4; weights" in out[-1] and "KV cache (this project's GPT)" in out[-1]
    with pytest.raises(SampleError, match=r"--dtype nf4 serves a run fine-tuned on an nf4 base .* holds no weights "
                                          r"in codes: give bf16, f16, f32 or int8"):
        Generator(str(runs[0]), "nf4")
    assert main(["sample", str(runs[0]), "--dtype", "nf4"]) == 2
    assert capsys.readouterr().err.count("\n") == 1


def test_a_qlora_run_of_a_hugging_face_gpt2_decodes_its_conv1d_codes_through_its_own_cache(tmp_path, capsys):
    # GPT-2's Conv1D kernels are (out, in), contracted on their blocks' axis: the other layout
    from helpers import flax_transformers
    from serving_models import huggingface_gpt2

    hf_dir = huggingface_gpt2(tmp_path / "gpt2", flax_transformers(), width=64)  # 64 x 192... kernels: in codes
    config = train.config.from_dict({
        "steps": 2, "progress": False, "inference_dtypes": [], "checkpoint_every": 2, "workdir": str(tmp_path / "run"),
        "model": {"name": "train.weights.huggingface:model", "path": str(hf_dir), "init_from": str(hf_dir),
                  "output": "logits"},
        "data": {"name": "synthetic_text", "num_classes": 21, "seq_len": 16, "batch_size": 4, "num_train": 2000,
                 "num_test": 200, "eval_batch_size": 8, "eval_batches": 1},
        "finetune": {"lora": {"rank": 2}, "base": "nf4"}, "optimizer": {"lr": 1e-2}})
    train.run(config, out=io.StringIO())
    source = load_source(tmp_path / "run")
    generator = Generator(source, "nf4")
    laid = [x for x in jax.tree_util.tree_leaves(generator.served.params, is_leaf=lambda x: hasattr(x, "code"))
            if isinstance(x, BlockCodes)]
    assert len(laid) == len(source.base.codes) == 8 and {x.contracted for x in laid} == {1}
    prompt = "ROMEO : the king"
    np.testing.assert_array_equal(generator.generate(prompt, 6, GREEDY).tokens,
                                  Generator(source, "nf4", cache=False).generate(prompt, 6, GREEDY).tokens)
    assert main(["sample", str(tmp_path / "run"), "--prompt", prompt, "--tokens", "4", "--dtype", "nf4"]) == 0
    assert "KV cache (the Hugging Face model's own) in bf16" in capsys.readouterr().out


@pytest.mark.gpu_compile
def test_the_h100_decode_step_reads_each_nf4_code_once():
    # Read as x . dequantize(codes), XLA wrote each weight dequantized in float32 and read it back: the
    # Shakespeare QLoRA step moved 6.3x the bytes a token reads; as one sum of x * S * L, 1.3x here.
    from helpers import needs_cuda_plugin
    from precision.quantized_weights import quantizable, quantize_weight
    from serving_models import gpt_source
    from train.serving.compiled import compile_decode_step
    from train.serving.stored_base import StoredBase

    needs_cuda_plugin()
    source = gpt_source(d_model=768, block_size=256)  # GPT-2 small's width, two layers
    flat = traverse_util.flatten_dict(source.params)
    codes = {p: quantize_weight(v, "nf4") for p, v in flat.items() if p[-1] == "kernel" and quantizable(v)}
    params = traverse_util.unflatten_dict(flat | {p: np.asarray(dequantize_weight(q)) for p, q in codes.items()})
    source = source._replace(params=params, base=StoredBase(source.model, params, codes, 0))
    half, nf4 = (compile_decode_step(Generator(source, dtype)) for dtype in ("bf16", "nf4"))
    assert nf4.weight_bytes < 0.3 * half.weight_bytes and nf4.modeled.bytes < 1.35 * nf4.bytes
    assert nf4.modeled.bytes < 0.45 * half.modeled.bytes and nf4.modeled.launches <= half.modeled.launches
    laid = {p: q for p, q in codes.items() if q.shape[1] % 64 == 0}  # not the head's 41 outputs: read dequantized
    assert len(laid) == 8
    for path, q in laid.items():  # each base matrix: its codes read once (dequantized and read back: ~8x)
        module = "/".join(path[:-1])
        moved = sum(m.kernel.bytes for m in nf4.modeled.kernels if m.kernel.module == module)
        assert moved < 1.3 * (q.codes.nbytes + q.scales.nbytes), module
