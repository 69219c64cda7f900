"""Int8 programs compiled without the device: every allow-listed matmul of a GPT step an
s8 x s8 -> s32 op of a TPU v5e's matrix unit and an A100's int8 GEMMs, the int8 share of the
matmul FLOPs and the modeled step's, and the targets that refuse a format.

Tests marked ``tpu_compile`` (``gpu_compile``) need libtpu (JAX's CUDA plugin), no device: CI
runs them in the compile-only environment. The rest run everywhere.
"""

import functools
import re

import jax
import jax.numpy as jnp
import pytest

import precision
from precision.autocast.scaled.int8_pallas import SCOPE
from helpers import ROOT, needs_cuda_plugin, needs_libtpu
from train.config import load_config
from train.inspections.compile_for import compile_for
from train.inspections.targets import TargetError, get_target, target_devices

GPT2_SMALL = ROOT / "configs" / "gpu" / "gpt2_small_mixed_bf16.yaml"
#: The GPT-2-small config made small enough to compile in seconds (the full one: docs/int8.md's commands).
SMALL = ("model.num_layers=1", "model.d_model=256", "model.num_heads=4", "data.num_classes=4096", "data.seq_len=256",
         "data.batch_size=8", "data.eval_batch_size=8")


@functools.lru_cache(maxsize=None)
def _compiled(target, policy):
    return compile_for(load_config(GPT2_SMALL, ["workdir=/tmp/unused", *SMALL, f"precision.policy={policy}"]), target)


@pytest.mark.tpu_compile
def test_every_projection_mlp_and_head_matmul_is_an_int8_mxu_op_on_v5e_forward_and_backward():
    needs_libtpu()
    report = _compiled("v5e", "mixed_int8")
    matmuls = [k for k in report.kernels if k.gemm]
    assert len(matmuls) == 12 + 3  # 4 projections x (forward + 2 backward), the head's 3
    assert {(k.operands, k.result) for k in matmuls} == {(("s8", "s8"), "s32")}
    # each one a Pallas kernel quantizing its 16-bit operand in VMEM (precision.autocast.scaled.int8_pallas)
    assert sum(f"/{SCOPE}/" in k.op_name for k in matmuls) == 15 and "block_0/Dense_0" in {k.module for k in matmuls}
    assert report.int8.share == 1.0 and report.int8.outside == () and report.fits
    assert "int8 share of matmul FLOPs (fused attention aside): 100.0%" in str(report)
    assert report.modeled.matmul_flops["s8"] == report.int8.int8_flops and report.modeled.xla_cycles > 0
    # a param's int8 gradient made in bf16 (as mixed_bf16 makes it), not written and read in float32
    assert set(re.findall(r"%int8_tiles_matmul[.\d]* = \(?(\w+)\[", report.hlo_text)) == {"bf16"}
    # the attention's output read heads-first, as the attention kernel writes it, by the projection's forward
    # and weight-gradient kernels; its input gradient written so (no layout copies between them)
    assert len(_kernel_lines(report, "block_0/attn/proj", "bf16[8,4,256,64]")) == 2
    assert len(_kernel_lines(report, "block_0/attn/proj", "bf16[8,4,256,64]", reads=False)) == 1


@pytest.mark.tpu_compile
def test_the_mlps_activation_and_the_projections_biases_ride_in_the_int8_kernels_on_v5e():
    """The GELU between the MLP's products is applied by the second's kernels (its forward reads the
    first's result as that kernel wrote it; its input gradient writes the first's result's gradient,
    which the first's input gradient reads as written); every bias is added in its product's kernel
    and summed by its weight gradient's (a second result): no pass of XLA's between the kernels."""
    needs_libtpu()
    by_module = _kernels_by_module(_compiled("v5e", "mixed_int8").hlo_text)
    # x, w, scales, bias, the norm's scale and offset (test_the_norms_ride_in_the_int8_kernels_that_read_them_on_v5e)
    (dense0, _, _), = [k for k in by_module[("Dense_0", "int8_rows_matmul")] if len(k[1]) == 6 and not k[2]]
    dense1_fwd, dense1_bwd = sorted(by_module[("Dense_1", "int8_rows_matmul")], key=lambda k: k[1][0] != dense0)
    assert dense1_fwd[1][0] == dense0  # the GELU's input, as the first kernel wrote it
    assert len(dense1_bwd[1]) == 4  # dy, w, scales and the GELU's input (as XLA's memory placement moved it)
    assert any(k[1][0] == dense1_bwd[0] for k in by_module[("Dense_0", "int8_rows_matmul")])  # h's gradient as written
    assert all(two for name in ("qkv", "proj", "Dense_0", "Dense_1", "head")
               for _, _, two in by_module[(name, "int8_tiles_matmul")])  # the weight's gradient, the bias's sums


@pytest.mark.tpu_compile
def test_the_norms_ride_in_the_int8_kernels_that_read_them_on_v5e():
    """Each LayerNorm's result is read by an int8 product (the query, key and value's, the MLP's first, the
    head): its forward kernel reads the norm's input and its scale and offset and normalizes its row blocks;
    its input gradient writes the norm's input's gradient and the scale's and offset's partial sums (three
    results); its weight gradient normalizes its token tiles. No pass of XLA's writes a norm's result."""
    needs_libtpu()
    report = _compiled("v5e", "mixed_int8")
    by_module = _kernels_by_module(report.hlo_text)
    for name in ("qkv", "Dense_0", "head"):
        rows, (tiles,) = by_module[(name, "int8_rows_matmul")], by_module[(name, "int8_tiles_matmul")]
        assert sorted(len(k[1]) for k in rows) == [6, 6], name  # forward: x, w, scales, bias, scale, offset
        forward, backward = sorted(rows, key=lambda k: k[2])
        assert not forward[2] and backward[2].count("f32[1,1,256]") == 2, name  # dx and the params' partial sums
        assert len(tiles[1]) == 4, name  # x, g, and the scale and offset: its token tiles normalized
    # no fusion of XLA's is left in a norm's module: its statistics, result and sums are all the kernels'
    norm_ops = [line for line in report.hlo_text.splitlines()
                if " fusion(" in line and re.search(r'op_name="[^"]*(LayerNorm_\d|ln_f)', line)]
    assert norm_ops == [], norm_ops[:2]


def _kernels_by_module(hlo_text):
    """``{(module, kernel): [(name, operands, result type)]}``: the int8 kernels' custom calls of a program."""
    by_module = {}
    for line in hlo_text.splitlines():
        if "tpu_custom_call" in line and f"/{SCOPE}/" in line:
            name, result = re.match(r"\s*%([\w.-]+) = (.*?) custom-call\(", line).groups()
            module = re.sub(r"precision\.module=", "", re.search(r'op_name="([^"]*)"', line).group(1)).split("/cond")[0]
            operands = re.search(r"custom-call\(([^)]*)\)", line).group(1).replace("%", "").split(", ")
            key = (module.rsplit("/", 1)[-1], name.rsplit(".", 1)[0])
            by_module.setdefault(key, []).append((name, operands, result if result.startswith("(") else ""))
    return by_module


def _kernel_lines(report, module, shape, reads=True):
    """The int8 kernels' custom calls of ``module`` reading (else writing) an array of ``shape``."""
    found = []
    for line in report.hlo_text.splitlines():
        if "tpu_custom_call" in line and f"{module}/" in line and f"/{SCOPE}/" in line:
            operands = line.split("operand_layout_constraints=")[1].split(", frontend_attributes")[0]
            found += [line] if (shape in operands if reads else f"= {shape}" in line.split("custom-call")[0]) else []
    return found


@pytest.mark.tpu_compile
def test_flax_attentions_output_projection_and_its_gradients_are_int8_kernels_on_v5e():
    """``nn.SelfAttention``'s output projection contracts heads and head features (a DenseGeneral over
    two axes): a matmul once its operands are viewed as matrices, so a Pallas kernel like the rest
    (it kept the XLA recipe, its operands quantized in passes of their own through HBM)."""
    needs_libtpu()
    config = load_config(ROOT / "examples" / "user_models" / "linen_gpt.yaml",
                         ["workdir=/tmp/unused", "precision.policy=mixed_int8", "model.width=256", "model.heads=4",
                          "model.layers=1", "model.max_len=256", "data.seq_len=256", "data.batch_size=8",
                          "data.num_classes=1024"])
    report = compile_for(config, "v5e")
    matmuls = [k for k in report.kernels if k.gemm]
    by_module = {}
    for k in matmuls:
        by_module.setdefault(k.module, []).append(f"/{SCOPE}/" in k.op_name)
    assert by_module["block_0/attn/out"] == [True] * 3, by_module  # forward, the input's and the weight's gradients
    assert all(all(kernels) for kernels in by_module.values()) and len(matmuls) == 3 * 7, by_module
    assert {(k.operands, k.result) for k in matmuls} == {(("s8", "s8"), "s32")} and report.int8.share == 1.0
    # the query, key and value written heads-first (as the attention kernel reads them), the attention's output
    # read so by the output projection (forward, weight gradient); the gradients the same way back
    for name in ("query", "key", "value"):
        assert len(_kernel_lines(report, f"block_0/attn/{name}", "bf16[8,4,256,64]", reads=False)) == 1, name
        assert len(_kernel_lines(report, f"block_0/attn/{name}", "bf16[8,4,256,64]")) == 2, name
    assert len(_kernel_lines(report, "block_0/attn/out", "bf16[8,4,256,64]")) == 2
    assert len(_kernel_lines(report, "block_0/attn/out", "bf16[8,4,256,64]", reads=False)) == 1


@pytest.mark.gpu_compile
def test_the_a100_program_has_int8_gemms_with_int32_results_and_no_xla_loop():
    needs_cuda_plugin()
    report = _compiled("a100", "mixed_int8")
    gemms = [k for k in report.kernels if k.gemm]
    assert {(k.operands, k.result) for k in gemms} == {(("s8", "s8"), "s32")}
    assert not any(k.kind == "xla_dot" for k in gemms) and report.int8.share == 1.0
    assert report.modeled is not None and "NVIDIA A100" in report.modeled.device


@pytest.mark.gpu_compile
@pytest.mark.parametrize("k", [768, 766])
def test_cublaslt_takes_int8_gemms_and_pads_a_k_it_does_not(k):
    """With XLA's Triton GEMMs off (what a tuned run may pick instead), each int8 product is a
    cuBLASLt GEMM with an s32 result; a K that is not a multiple of 4 is padded first."""
    needs_cuda_plugin()
    from jax.sharding import SingleDeviceSharding

    from train.inspections.gpu_kernels import read_kernels

    device = SingleDeviceSharding(target_devices(get_target("a100"))[0])
    fn = precision.autocast(lambda w, x: jnp.mean(jnp.tanh(x @ w) ** 2), "mixed_int8", int8={"min_size": 0})
    args = (jax.ShapeDtypeStruct((k, 512), jnp.float32, sharding=device),
            jax.ShapeDtypeStruct((256, k), jnp.float32, sharding=device))
    text = jax.jit(jax.grad(fn)).lower(*args).compile(compiler_options={"xla_gpu_enable_triton_gemm": False}).as_text()
    gemms = [g for g in read_kernels(text) if g.gemm]
    assert [(g.kind, g.operands, g.result) for g in gemms] == [("cublaslt", ("s8", "s8"), "s32")] * 2
    assert (" pad(" in text) == (k % 4 != 0)


def test_an_fp8_policy_for_an_a100_is_refused_in_one_line_naming_int8():
    config = load_config(GPT2_SMALL, ["workdir=/tmp/unused", "precision.policy=mixed_fp8"])
    with pytest.raises(TargetError, match="has no FP8 matrix units; use precision.policy=mixed_int8") as caught:
        compile_for(config, "a100")
    assert "\n" not in str(caught.value)
    assert get_target("a100").int8 and not get_target("a100").fp8 and get_target("h100").fp8


def test_the_int8_share_counts_flops_by_launch_and_names_what_stays_out():
    from train.inspections.hlo_kernels import HloKernel
    from train.inspections.int8_share import int8_share
    from train.inspections.tpu_time import xla_estimated_cycles

    kernels = [HloKernel("a", "gemm", 12, 1.0, 90.0, "s8", "layers/mlp"),
               HloKernel("b", "conv", 1, 1.0, 80.0, "bf16", "head"),
               HloKernel("c", "attention", 1, 1.0, 500.0, "bf16", "attn"),
               HloKernel("d", "fusion", 1, 5.0, 0.0, "f32", "")]
    share = int8_share(kernels)
    assert share.share == 1080 / 1160 and share.outside == (("head", "bf16", 80.0),)
    assert "not int8: head (bf16, 6.90% of the FLOPs)" in "\n".join(share.lines())
    cycles = 'backend_config={{"estimated_cycles":"{}"}}'.format
    text = (f'%fused_computation.1 (p: f32[4]) -> f32[4] {{\n  %x = f32[4] add(%p, %p), {cycles(7)}\n}}\n'
            f'ENTRY %main (a: f32[4]) -> f32[4] {{\n  %f = f32[4] fusion(%a), {cycles(100)}\n'
            f'  ROOT %g = f32[4] fusion(%f), {cycles(23)}\n}}\n')
    assert xla_estimated_cycles(text) == 123  # a fused computation's ops are its fusion's
