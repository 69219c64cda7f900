"""Our train step against a hand-written one, compiled for an H100 without one (issue: the
framework's own cost to zero): kernel launches and bytes of the optimized programs, so a
change that adds kernels to our step fails here. Needs JAX's CUDA plugin (``gpu_compile``).

The hand-written steps are :mod:`benchmarks.step_cost`'s: the same model written in the half
dtype with cuDNN attention, float32 loss, ``jax.grad``, AdamW, and jmp's dynamic loss scale
under float16. The limits are today's figures with a little room (``python -m
benchmarks.step_cost`` prints them): bfloat16 adds the one-pass finiteness check the
hand-written step does not make, and XLA's split-K GEMM reductions it then keeps apart; under
float16 the hand-written step's per-leaf ``jmp.all_finite`` costs more than our check. Both
are below the hand-written step since each LayerNorm's backward is computed in closed form
(``precision.autocast.norm_fusion``: four kernels where Flax's op-by-op backward takes six).
The loss reads its logits twice since 2026-11-30 (1.65 GB more than one pass, bytes ratio 0.89
-> 0.92): an H200 ran the two passes faster than the one-pass fold, whose two exponentials a
logit the model, which counts bytes, does not see.
"""

import pytest

from helpers import h100_device as _device, needs_cuda_plugin
from train.inspections.targets import get_target

gpu_compile = pytest.mark.gpu_compile


@pytest.fixture(autouse=True)
def _needs_plugin():
    needs_cuda_plugin()


@gpu_compile
@pytest.mark.parametrize("policy,kernels,bytes_moved", [("mixed_bf16", 0.97, 0.93), ("mixed_f16", 0.77, 0.93)])
def test_our_gpt2_small_step_launches_and_moves_no_more_than_the_hand_written_one(policy, kernels, bytes_moved):
    from benchmarks.step_cost import compare, models

    row = compare(models()["gpt"], policy, get_target("h100"), _device())
    assert row["kernels_ratio"] <= kernels, (row["ours"]["kernels"], row["hand_written"]["kernels"])
    assert row["bytes_ratio"] <= bytes_moved, row["bytes_ratio"]
    # below the hand-written step: the loss fuses its gradient, the norms are differentiated in closed form
    assert row["ours"]["modeled_seconds"] <= 0.95 * row["hand_written"]["modeled_seconds"]


@gpu_compile
def test_the_resnet_step_launches_and_moves_less_than_the_hand_written_one():
    """The ResNet's check reads all its convolution kernels' gradients in one reduction (each
    had its own, which XLA split in two: 381 kernels, 354 after), and its BatchNorms'
    backward is computed in closed form, one reduction a norm for the input's, the scale's
    and the offset's sums (296 kernels against the hand-written step's 325)."""
    from benchmarks.step_cost import compare, models

    row = compare(models()["resnet"], "mixed_bf16", get_target("h100"), _device())
    assert row["kernels_ratio"] <= 0.93, (row["ours"]["kernels"], row["hand_written"]["kernels"])
    assert row["bytes_ratio"] <= 1.0, row["bytes_ratio"]


@gpu_compile
def test_the_step_cost_benchmark_writes_its_table(tmp_path):
    from benchmarks import step_cost

    # one model: the ResNet's row is the comparison test_the_resnet_step_... makes (20 s of CI's CPU)
    argv = ["--layers", "1", "--models", "llama", "--policies", "O2", "--out", str(tmp_path)]
    assert step_cost.main(argv) == 0
    text = (tmp_path / "step-cost-h100.md").read_text()
    assert "| llama | O2 |" in text and "not a measurement" in text
