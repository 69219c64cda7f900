"""Serving a user's NNX language model (issue 70): an NNX LM has no cache this project can
keep, so it samples without one (the whole prefix each token), in every weights dtype, with
the doctor; a QLoRA fine-tuning of it (nf4 base) finishes its run and serves its base as stored."""

import io
import pathlib

import numpy as np
import pytest

import train
from helpers import TINY_TEXT
from train.cli import main
from train.serving import Generator, SampleError, Sampling, load_source

GREEDY = Sampling(temperature=0)
NNX_LM = str(pathlib.Path(__file__).resolve().parent.parent / "examples" / "user_models" / "nnx_lm.py") + ":LM"


def _train(workdir, text, **sections):
    model = {"name": NNX_LM, "max_len": 32, "width": 64, "heads": 2, "layers": 2}
    config = train.config.from_dict({
        "workdir": str(workdir), "steps": 30, "progress": False, "checkpoint_every": 30, "eval_every": 0,
        "model": model | sections.pop("model", {}), "optimizer": {"lr": 3e-3, "warmup_steps": 0},
        "precision": {"policy": "mixed_bf16"},
        "data": {"name": "shakespeare", "path": str(text), "seq_len": 32, "batch_size": 8, "eval_batch_size": 8,
                 "eval_batches": 2}, **sections})
    out = io.StringIO()
    train.run(config, out=out)
    return workdir, out.getvalue()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The NNX LM trained on a tiny text, and a QLoRA fine-tuning of it (rank 4 on an nf4 base)."""
    root = tmp_path_factory.mktemp("nnx_lm")
    (root / "plays.txt").write_text(TINY_TEXT)
    base, _ = _train(root / "base", root / "plays.txt", inference_dtypes=[])  # vocab_size: the data's
    qlora, printed = _train(root / "qlora", root / "plays.txt", finetune={"lora": {"rank": 4}, "base": "nf4"},
                            model={"init_from": str(base)})
    return base, qlora, printed



def test_an_nnx_lm_samples_without_a_cache_in_every_weights_dtype(runs):
    source = load_source(runs[0])
    windows = np.asarray(next(iter(source.data.eval_batches(4, 1)))["inputs"])
    generators = {d: Generator(source, d) for d in ("f32", "bf16", "f16", "int8")}
    assert {g.decoder.kind for g in generators.values()} == {"none"}
    logits = {d: g.logits(windows) for d, g in generators.items()}
    for dtype in ("bf16", "f16", "int8"):  # each follows float32, teacher-forced at every position
        assert np.mean(logits[dtype].argmax(-1) == logits["f32"].argmax(-1)) > 0.97, dtype
    assert "int8 (a scale per output channel)" in generators["int8"].served.describe()
    sizes = [generators[d].served.bytes for d in ("f32", "bf16", "int8")]
    assert sizes[0] > 1.9 * sizes[1] and sizes[1] > 1.6 * sizes[2], sizes
    prompt = TINY_TEXT[:6]
    assert generators["bf16"].generate(prompt, 8, GREEDY).tokens.shape == (1, 8)


def test_sample_serves_it_with_the_doctor_and_refuses_a_cache_dtype(runs, capsys):
    prompt = TINY_TEXT[:6]
    assert main(["sample", str(runs[0]), "--prompt", prompt, "--tokens", "6", "--dtype", "f16", "--diagnose"]) == 0
    out = capsys.readouterr().out
    assert "; f16; weights" in out and "no KV cache (the whole prefix each token)" in out
    assert "doctor, prefill:" in out and "doctor, decode step:" in out
    with pytest.raises(SampleError, match=r"--kv-dtype int8: LM keeps no KV cache .* leave --kv-dtype out"):
        Generator(str(runs[0]), "bf16", "int8")
    assert main(["sample", str(runs[0]), "--prompt", prompt, "--kv-dtype", "bf16"]) == 2
    assert capsys.readouterr().err.count("\n") == 1


def test_a_qlora_fine_tuning_of_it_finishes_and_serves_its_nf4_base_as_stored(runs):
    assert "inference accuracy: float32" in runs[2]  # the run's end, its base in codes read back in each dtype
    source = load_source(runs[1])
    nf4 = Generator(source, "nf4")
    assert "in nf4 codes as stored (a scale per 64 values)" in nf4.served.describe()
    assert nf4.served.bytes < 0.6 * Generator(source, "bf16").served.bytes
    windows = np.asarray(next(iter(source.data.eval_batches(4, 1)))["inputs"])
    served, f32 = nf4.logits(windows), Generator(source, "f32").logits(windows)
    assert np.mean(served.argmax(-1) == f32.argmax(-1)) > 0.97
    assert np.abs(served - f32).max() < 0.1 * np.abs(f32).max()
