"""Fine-tuning compiled for an H100 without one (issue 56): a LoRA step on a frozen nf4 base
holds a fraction of full fine-tuning's state, its frozen weight-gradient GEMMs are gone, and
its adapters' GEMMs run in bf16. Needs JAX's CUDA plugin (``gpu_compile``)."""

import jax
import jax.numpy as jnp
import pytest

from helpers import h100_device as _device, needs_cuda_plugin
from train.inspections.targets import get_target

gpu_compile = pytest.mark.gpu_compile


@pytest.fixture(autouse=True)
def _needs_plugin():
    needs_cuda_plugin()


def _compiled(finetune, vocab=4096, width=256, layers=2, batch=(8, 256)):
    import optax

    import train
    from train.inspections.compile_for import compile_train_step
    from train.models import GPT
    from train.parallel.distributed import Layout, make_mesh

    model = GPT(vocab_size=vocab, block_size=batch[1], num_layers=layers, num_heads=4, d_model=width)
    state = jax.eval_shape(lambda: train.create_train_state(model, "mixed_bf16", optax.adamw(1e-4), jax.random.key(0),
                                                            jnp.zeros((1, batch[1]), jnp.int32), finetune=finetune))
    tokens = jax.ShapeDtypeStruct(batch, jnp.int32)
    return compile_train_step(state, {"inputs": tokens, "labels": tokens}, Layout(make_mesh(1, 1, [_device()])),
                              get_target("h100"), task="language_model")


@gpu_compile
def test_a_qlora_step_compiled_for_an_h100_holds_a_fraction_of_full_fine_tunings_state():
    import train

    full = _compiled(None)
    lora = _compiled(train.FineTune(lora=train.LoRA(8, targets=(r"block_\d+/.*",)), base="nf4"))
    assert lora.memory["argument"] < 0.2 * full.memory["argument"], (lora.memory, full.memory)
    from train.inspections.hlo_kernels import read_hlo_kernels

    gemms = lambda step: [k for k in read_hlo_kernels(step.hlo_text) if k.kind == "gemm"]  # noqa: E731
    assert len(gemms(lora)) > 0 and all(k.dtype == "bf16" for k in gemms(lora)), {k.dtype for k in gemms(lora)}
    # frozen blocks: no weight-gradient GEMM of their kernels; the adapters' thin ones instead
    big = lambda step: [k for k in gemms(step) if k.flops >= 2 * 8 * 256 * 256 * 256]  # noqa: E731
    assert len(big(lora)) < len(big(full)), (len(big(lora)), len(big(full)))


@gpu_compile
def test_an_nf4_base_peaks_no_higher_than_an_int8_one():
    """Half the int8 base's bytes, and no more temporaries: nf4's codes are read elementwise
    (no 4-bit indices unpacked into a buffer per weight), and each matmul reading a frozen
    weight dequantizes it again in its backward pass (precision.autocast.frozen_reads) rather
    than keep a bfloat16 copy from the forward one. Weights dominate here (one block, width
    512, a 16,384-token head, 64 tokens): nf4 peaked at 50.6 MiB against int8's 46.1 with
    those copies kept (temporaries 37.5 against 23.5), 36.3 against 45.8 without."""
    import train

    steps = {base: _compiled(train.FineTune(lora=train.LoRA(8), base=base), vocab=16384, width=512, layers=1,
                             batch=(1, 64)) for base in ("int8", "nf4")}
    int8, nf4 = steps["int8"].memory, steps["nf4"].memory
    assert nf4["argument"] < int8["argument"] and nf4["temp"] <= int8["temp"], (nf4, int8)
    assert nf4["peak"] <= int8["peak"], (nf4, int8)
