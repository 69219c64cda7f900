"""Compiling for a TPU slice without one: targets, slices, the policies a TPU refuses, and
the program libtpu's compiler makes, read back.

Tests marked ``tpu_compile`` need libtpu (``pip install '.[tpu-compile]'``; no TPU): CI runs
them in the compile-only environment. The rest run everywhere.
"""

import collections
import functools
import json
import subprocess
import sys

import pytest

from helpers import ROOT, needs_libtpu, subprocess_env
from train.config import load_config
from train.config.tpu_policy import tpu_policy_problem
from train.inspections.compile_for import compile_for
from train.inspections.targets import TargetError, TpuTarget, get_target, slice_topology
from train.inspections.tpu_kernels import read_tpu_kernels

GPT2_SMALL = ROOT / "configs" / "gpu" / "gpt2_small_mixed_bf16.yaml"
#: The GPT-2-small config made small enough to compile in seconds (the full one: benchmarks.compiled --target v5e).
SMALL = ("model.num_layers=1", "model.d_model=256", "model.num_heads=4", "data.num_classes=4096", "data.seq_len=256",
         "data.batch_size=8", "data.eval_batch_size=8")
tpu_compile = pytest.mark.tpu_compile


@pytest.fixture(autouse=True)
def _needs_libtpu(request):
    if request.node.get_closest_marker("tpu_compile"):
        needs_libtpu()


@functools.lru_cache(maxsize=None)
def _compiled(target, *overrides, devices=None):
    return compile_for(load_config(GPT2_SMALL, ["workdir=/tmp/unused", *SMALL, *overrides]), target, devices)


# ----------------------------------------------------------------------------- the program libtpu compiles


@tpu_compile
def test_the_gpts_fused_query_key_value_is_made_part_by_part_without_layout_copies(monkeypatch):
    """The GPT makes q, k and v with one matmul and splits it (precision.autocast.projection_split): on one
    TPU each part is its own matmul, written heads-first, and the copies laying the one matmul's result
    out for the attention kernel are gone (its size thresholds set to 0: this GPT is far below them)."""
    from precision.autocast import projection_split

    def attention(report):
        qkv = [k for k in report.kernels if k.gemm and k.module == "block_0/attn/qkv"]
        copies = [line for line in report.hlo_text.splitlines() if " copy(" in line and "block_0/attn" in line]
        return len(qkv), len(copies)

    one, copies_whole = attention(_compiled("v5e"))  # the other tests' program: below the thresholds
    monkeypatch.setattr(projection_split, "MIN_ELEMENTS", 0)
    monkeypatch.setattr(projection_split, "MIN_ROWS_PER_INPUT", 0)
    parts, copies = attention(_compiled("v5e", "precision.split_projections=true"))
    assert (parts, one) == (9, 3)  # forward and two backward products, of each part or of the whole
    assert copies < copies_whole, (copies, copies_whole)


@tpu_compile
def test_the_gpt_compiles_for_one_v5e_chip_with_every_matmul_in_bfloat16(tmp_path):
    from train.inspections.compile_for import write_report

    report = _compiled("v5e")
    assert isinstance(report.target, TpuTarget) and report.devices == 1 and report.fits
    matmuls = [k for k in report.kernels if k.gemm]
    # per layer: 4 projections, each forward and twice backward; the head's 3. The attention's
    # products are in the Pallas (splash) attention: one kernel forward, two backward (dq; dk, dv).
    assert len(matmuls) == 12 + 3 and {k.kind for k in matmuls} == {"tpu_matmul"}
    assert {k.operands for k in matmuls} == {("bf16", "bf16")} and report.f32_gemms() == {}
    assert _attention_kernels(report) == {("tpu_flash_attention", "block_0/attn"): 1,
                                          ("tpu_flash_attention_backward", "block_0/attn"): 2}
    assert {k.operands for k in report.kernels if "flash" in k.kind} == {("bf16", "bf16", "bf16")}
    assert "TPU matmul (MXU)" in str(report) and "Pallas flash attention (bwd)" in str(report)
    assert "Modeled step time on TPU v5e" in str(report)  # a roofline of the datasheet (train.inspections.tpu_time)
    written = json.loads(open(write_report(report, str(tmp_path))).read())
    assert written["target"] == "v5e" and written["device_kind"] == "TPU v5 lite" and written["fits"]


@tpu_compile
def test_float32_matmuls_run_one_bfloat16_pass_on_a_tpu_six_at_highest():
    """What the report says of a float32 matmul's arithmetic, from programs libtpu compiled (a
    train step's: the fp32 and fp32_highest rows of benchmarks/results/v5e-compiled.md)."""
    import jax
    import jax.numpy as jnp

    from train.inspections.targets import target_devices

    device = target_devices(get_target("v5e"))[0]
    x = jax.ShapeDtypeStruct((256, 256), jnp.float32, sharding=jax.sharding.SingleDeviceSharding(device))
    found = {}
    for asked in ("default", "high", "highest"):
        text = jax.jit(lambda a, b: jnp.dot(a, b, precision=asked)).lower(x, x).compile().as_text()
        found[asked] = [k.algorithm for k in read_tpu_kernels(text)]
    assert found == {"default": ["bf16"], "high": ["bf16_3x"], "highest": ["bf16_6x"]}


@tpu_compile
def test_a_v5p_slice_of_eight_chips_gathers_fsdp_params_in_bfloat16():
    report = _compiled("v5p", "mesh.fsdp=8", devices=8)
    assert report.devices == 8 and report.mesh == {"data": 1, "fsdp": 8, "tensor": 1}
    assert report.target.device_kind == "TPU v5" and report.communication.stage == "partitioned"
    gathers = {r["dtype"] for r in report.communication.rows()
               if r["carries"] == "params" and r["kind"] == "all-gather"}
    assert gathers == {"bf16"}, report.communication.rows()
    assert "Collectives per step (partitioned program, v5p)" in str(report)
    # each chip runs the fused attention on its own rows of the batch (the step's mesh in context)
    assert _attention_kernels(report) == {("tpu_flash_attention", "block_0/attn"): 1,
                                          ("tpu_flash_attention_backward", "block_0/attn"): 2}
    # (the splash kernel, no bias: one chip's batch row of the 8, its 4 heads and 256 positions whole)
    splash = next(line for line in report.hlo_text.splitlines() if "splash_mha_fwd_residuals." in line)
    assert "bf16[4,256,64]" in splash


def _attention_kernels(report):
    return dict(collections.Counter((k.kind, k.module) for k in report.kernels if "flash" in k.kind))


@tpu_compile
def test_a_given_slice_gives_all_its_chips_and_no_more():
    from train.inspections.targets import target_devices

    assert len(target_devices(get_target("v5p:2x2x2"))) == 8 and len(target_devices(get_target("v5p"), 8)) == 8
    assert {d.device_kind for d in target_devices(get_target("v6e"), 4)} == {"TPU v6 lite"}
    with pytest.raises(TargetError, match="--devices 16 is more than the 8 chips of the slice v5p:2x2x2"):
        target_devices(get_target("v5p:2x2x2"), 16)


# ----------------------------------------------------------------------------- everywhere


@pytest.mark.parametrize("name,count,topology", [
    ("v5e", 1, "v5e:2x2"), ("v5e", 4, "v5e:2x2"), ("v5e", 8, "v5e:2x4"), ("v5e", 32, "v5e:4x8"),
    ("v6e", 256, "v6e:16x16"), ("v5p", 1, "v5p:2x2x1"), ("v5p", 8, "v5p:2x2x2"), ("v5p", 16, "v5p:2x2x4"),
    ("v5p", 64, "v5p:4x4x4"), ("v5p:4x4x4", 8, "v5p:4x4x4"),
])
def test_the_slice_is_the_smallest_holding_the_devices(name, count, topology):
    assert slice_topology(get_target(name), count) == topology


def test_tpu_targets_and_their_errors():
    v5p = get_target("v5p:2x2x2")
    assert v5p.topology == "2x2x2" and v5p.memory_bytes == 95 * 2 ** 30 and not v5p.fp8
    assert get_target(" V5E ").name == "v5e"
    with pytest.raises(TargetError, match=r"unknown v5p slice '2x2': give 3 chip counts, as in v5p:2x2x2"):
        get_target("v5p:2x2")
    with pytest.raises(TargetError, match="give one of h100, h200, a100, v5e, v5p, v6e"):
        get_target("v4")


@pytest.mark.parametrize("policy,found", [
    ("mixed_f16", "float16 is not native on a TPU"), ("O2", "float16 is not native"),
    ("params=f32,compute=bf16,output=f16", "float16 is not native"),
    ("mixed_fp8", "none of these TPU generations multiplies FP8"), ("mixed_bf16", ""), ("fp32", ""),
])
def test_what_a_tpu_cannot_compute_in(policy, found):
    problem = tpu_policy_problem(policy, get_target("v5e"))
    assert (found in problem) if found else problem == ""
    assert (not found) or "precision.policy=mixed_bf16" in problem


@pytest.mark.parametrize("override,where", [
    ("precision.policy=mixed_f16", "precision.policy=mixed_f16 for v5e"),
    ("precision.rules=[['block_0', 'params=f32,compute=f16']]", "precision.rules[0]=params=f32,compute=f16 for v5e"),
])
def test_compile_for_a_tpu_refuses_float16_in_one_line_naming_mixed_bf16(override, where, tmp_path, capsys):
    from train.cli import main

    code = main([str(GPT2_SMALL), "--compile-for", "v5e", override, f"workdir={tmp_path}"])
    err = capsys.readouterr().err
    assert code == 2 and where in err and "use precision.policy=mixed_bf16" in err and err.count("\n") == 1


@tpu_compile
def test_a_step_the_tpu_compiler_refuses_for_memory_does_not_fit_in_one_line_with_what_to_try(tmp_path, capsys):
    """XLA:TPU does not compile a program past the chip's HBM (XLA:GPU plans one, and the report
    says it does not fit): 512 x 1024 tokens of a one-layer GPT is the compiler's error, said as a
    step that does not fit (exit 1, no report), not a traceback from inside JAX."""
    from train.cli import main

    code = main([str(GPT2_SMALL), "--compile-for", "v5e", f"workdir={tmp_path}", "model.num_layers=1",
                 "model.d_model=256", "model.num_heads=4", "data.batch_size=512", "data.num_test=2048",
                 "precision.blockwise_loss=false"])
    err = capsys.readouterr().err
    assert code == 1 and err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith("error: one train step of gpt (26.9M params), policy mixed_bf16, batch 512 x 1024 tokens "
                          "does not fit 1 v5e device(s)") and "exceeds available HBM" in err and "remat=full" in err
    assert not (tmp_path / "compiled-v5e.json").exists()


@pytest.mark.parametrize("policy,noted", [("mixed_f16", True), ("O2", True), ("mixed_bf16", False)])
def test_a_run_on_a_tpu_notes_a_float16_policy_in_one_line(policy, noted):
    from train.experiment.loop import tpu_notes

    config = load_config(GPT2_SMALL, ["workdir=/tmp/unused", f"precision.policy={policy}"])
    notes = tpu_notes(config, backend="tpu")
    assert notes == ([f"note: precision.policy={policy} for a TPU: float16 is not native on a TPU (its matrix "
                      f"units multiply bfloat16; XLA would emulate float16), and loss scaling is not needed for "
                      f"bfloat16: use precision.policy=mixed_bf16"] if noted else [])
    assert tpu_notes(config, backend="cpu") == [] and tpu_notes(config, backend="gpu") == []


def test_without_libtpu_compile_for_a_tpu_names_what_to_install(tmp_path):
    from helpers import has_libtpu

    if has_libtpu():
        pytest.skip("libtpu is installed here")
    result = subprocess.run([sys.executable, "-m", "train", str(GPT2_SMALL), "--compile-for", "v5e",
                             f"workdir={tmp_path}"], capture_output=True, text=True,
                            env=subprocess_env(JAX_PLATFORMS="cpu"), cwd=ROOT, timeout=300)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert result.stderr.count("\n") == 1 and "pip install '.[tpu-compile]'" in result.stderr


def test_the_tpu_reader_finds_matmuls_in_fusions_with_their_operands_and_arithmetic():
    text = """HloModule m, entry_computation_layout={()->f32[]}

%fused (p0: bf16[8,16], p1: bf16[16,4]) -> bf16[8,4] {
  %p0 = bf16[8,16]{1,0:T(8,128)(2,1)} parameter(0)
  %p1 = bf16[16,4]{1,0:T(8,128)(2,1)} parameter(1)
  ROOT %convolution.1 = bf16[8,4]{1,0} convolution(%p0, %p1), dim_labels=bf_io->bf, metadata={op_name="jit(step)/precision.module=/block_0/precision.module=block_0/qkv/dot_general"}
}

ENTRY %main (a: bf16[8,16], b: bf16[16,4], c: f32[4,4], d: f32[4,4]) -> f32[4,4] {
  %a = bf16[8,16]{1,0} parameter(0)
  %b = bf16[16,4]{1,0} parameter(1)
  %c = f32[4,4]{1,0} parameter(2)
  %d = f32[4,4]{1,0} parameter(3)
  %fusion.1 = bf16[8,4]{1,0} fusion(%a, %b), kind=kOutput, calls=%fused
  %convolution.2 = f32[4,4]{1,0} convolution(%c, %d), dim_labels=bf_io->bf, operand_precision={highest,highest}
  ROOT %convolution.3 = f32[4,4]{1,0} convolution(%c, %convolution.2), dim_labels=bf_io->bf
}
"""
    kernels = read_tpu_kernels(text)
    assert [(k.operands, k.module, k.algorithm) for k in kernels] == [
        (("bf16", "bf16"), "block_0/qkv", ""), (("f32", "f32"), "", "bf16_6x"), (("f32", "f32"), "", "bf16")]
