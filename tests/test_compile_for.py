"""Compiling for a GPU without one: the H100 program a policy makes, read back.

Tests marked ``gpu_compile`` need JAX's CUDA plugin (``pip install
'.[gpu-compile]'``; no GPU, no driver): CI runs them in an environment of their
own. The rest (the reader of compiled programs, targets, the CLI's errors, the
choice by platform) run everywhere.
"""

import functools
import json
import re
import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import precision
from precision.doctor import probe
from helpers import ROOT, TINY_TEXT, h100_device, subprocess_env, tiny_fashion_mnist
from train.inspections.compile_for import compile_for
from train.config import load_config
from train.inspections.gpu_kernels import module_of, read_kernels, region_of
from train.inspections.targets import TargetError, get_target, target_devices

GPT2_SMALL = ROOT / "configs" / "gpu" / "gpt2_small_mixed_bf16.yaml"
#: Every shipped config but the GPT-2-small one (its own tests above) and a user's model from YAML.
SHIPPED = ([p for p in sorted((ROOT / "configs").rglob("*.yaml")) if p != GPT2_SMALL]
           + sorted((ROOT / "examples" / "user_models").glob("*.yaml")))


def _plugin() -> bool:
    return h100_device() is not None


gpu_compile = pytest.mark.gpu_compile


@pytest.fixture(autouse=True)
def _needs_plugin(request):
    if request.node.get_closest_marker("gpu_compile") and not _plugin():
        pytest.skip("needs JAX's CUDA plugin (no GPU): pip install '.[gpu-compile]'")


@functools.lru_cache(maxsize=None)
def _compiled(path, *overrides, devices=None):
    return compile_for(load_config(path, ["workdir=/tmp/unused", *overrides]), "h100", devices)


# ----------------------------------------------------------------------------- the GPT-2-small step on an H100


@gpu_compile
def test_gpt2_small_half_steps_fuse_attention_in_every_layer_with_half_gemms_and_a_third_of_the_memory():
    """mixed_bf16 and mixed_f16 (one test: three GPT-2-small compiles shared, not six)."""
    fp32 = _compiled(GPT2_SMALL, "precision.policy=fp32")
    assert fp32.count("cudnn_attention") == 0 and fp32.f32_gemms()  # the baseline is what it says
    for policy, half in (("mixed_bf16", "bf16"), ("mixed_f16", "f16")):
        report = _compiled(GPT2_SMALL, f"precision.policy={policy}")
        for kind in ("cudnn_attention", "cudnn_attention_backward"):
            calls = [k for k in report.kernels if k.kind == kind]
            assert sorted(k.module for k in calls) == sorted(f"block_{i}/attn" for i in range(12)), kind
            assert all(k.operands == (half,) * 3 for k in calls)
        gemms = [k for k in report.kernels if k.gemm]
        assert len(gemms) == 12 * 12 + 3  # per block 4 forward, 8 backward; the head 3
        assert report.f32_gemms() == {} and all(set(k.operands) == {half} for k in gemms), report.kernel_rows()
        assert report.memory["temp"] <= 0.35 * fp32.memory["temp"], (report.memory, fp32.memory)
        assert report.fits
    # skip_with="auto" follows the lowering's platform: select on a GPU (a cond on a CPU), so the
    # loss-scaled f16 step (loss_scale auto: dynamic) has no conditional.
    assert report.hlo_text and " conditional(" not in report.hlo_text
    _check_the_documented_output(_compiled(GPT2_SMALL, "precision.policy=mixed_bf16"))
    _check_the_update_launches_few_kernels(_compiled(GPT2_SMALL, "precision.policy=mixed_bf16"))


def _check_the_update_launches_few_kernels(report):
    """The optimizer wrapper's finiteness check and norm (issue 36: the H200 step was 11% slower
    than a hand-written one): one reduction per large leaf (XLA may split it in two) and one per
    size of small leaves, one select for them all; before, 202 reductions and 133 scalar selects."""
    from precision.grad_norms import SMALL_LEAF

    entry = report.hlo_text[report.hlo_text.index("ENTRY"):]
    update = [line for line in entry.splitlines() if re.search(r"= \S+ fusion\(", line)
              and "op_name=" in line and "jvp(" not in line.split("op_name=")[1]]
    reductions = [line for line in update if "kind=kInput" in line]
    scalar_selects = [line for line in update if re.search(r"= f32\[\] fusion\(", line) and "select" in line]
    large = 12 * 4 + 3  # per block: qkv, proj, fc, out kernels; token and position embeddings, the head
    assert len(reductions) <= 2 * large + 8, len(reductions)
    assert len(scalar_selects) <= 2, len(scalar_selects)
    assert SMALL_LEAF >= 3072 * 4  # the GPT's biases and norm scales are small leaves


def _check_the_documented_output(report):
    """docs/compile-for.md's output block, but for the first line's times (a CLI run prints
    this report: the CLI itself is run by the does-not-fit test)."""
    from docs_pages import blocks

    page = ROOT / "docs" / "compile-for.md"
    shown = next(b.text for b in blocks(page) if b.lang == "" and b.text.startswith("Compiled for"))
    printed = str(report).splitlines()
    assert printed[0].startswith(shown.splitlines()[0].split(") in ")[0])
    # the modeled time's figures move with any kernel XLA adds or removes: its lines are compared
    # without their digits
    model_at = next(i for i, line in enumerate(printed) if line.startswith("Modeled step time"))
    assert printed[1:model_at] == shown.splitlines()[1:model_at]
    digitless = [re.sub(r"[0-9]+", "#", line) for line in printed[model_at:]]
    assert digitless == [re.sub(r"[0-9]+", "#", line) for line in shown.splitlines()[model_at:]]


@gpu_compile
def test_mixed_fp8_with_min_size_0_gives_an_fp8_gemm_for_every_fp8_matmul():
    overrides = ("precision.policy=mixed_fp8", "precision.fp8.min_size=0", "model.num_layers=2", "model.d_model=256",
                 "model.num_heads=4", "data.seq_len=256", "data.batch_size=8")
    report = _compiled(GPT2_SMALL, *overrides)
    explanation = _explained(GPT2_SMALL, *overrides)
    assert explanation.fp8_share > 0.95
    fp8 = [k for k in report.kernels if k.fp8]
    assert len(fp8) == report.count() == 2 * 12 + 3  # every GEMM: the matmuls attention leaves to cuDNN aside
    assert all(k.operands in (("f8e4m3fn", "f8e4m3fn"), ("f8e5m2", "f8e4m3fn"), ("f8e4m3fn", "f8e5m2")) for k in fp8)
    assert report.count("cudnn_attention") == 2 and report.f32_gemms() == {}
    # issue 42: every one a cuBLASLt FP8 GEMM (a named dot algorithm: no Triton f8 GEMM, which accumulates
    # imprecisely), the forward ones in cuBLASLt's fast accumulation, the backward ones in float32
    assert {k.kind for k in fp8} == {"cublaslt_fp8"}
    backward = [k for k in fp8 if "transpose(" in k.op_name]
    assert len(backward) == 2 * len(fp8) // 3 and {k.accumulation for k in backward} == {"float32"}
    assert {k.accumulation for k in fp8 if k not in backward} == {"fast"}


def _explained(path, *overrides):
    from train.inspections.explain import explain_experiment

    return explain_experiment(load_config(path, ["workdir=/tmp/unused", *overrides]))


@gpu_compile
@pytest.mark.parametrize("mesh", [("2", "4"), ("1", "8")], ids=["data2_fsdp4", "fsdp8"])
def test_an_fsdp_step_on_8_h100s_gathers_params_in_bf16_and_its_gemms_stay_half(mesh):
    data, fsdp = mesh
    report = _compiled(GPT2_SMALL, "model.num_layers=2", "model.d_model=256", "model.num_heads=4",
                       "data.seq_len=128", "data.batch_size=16", f"mesh.data={data}", f"mesh.fsdp={fsdp}", devices=8)
    gathers = report.communication.select(carries="params", kind="all-gather")
    assert gathers and {c.dtype for c in gathers} == {"bf16"}
    assert report.devices == 8 and report.f32_gemms() == {}  # reduce_dtype auto (f32 on a mesh): bf16 x bf16 -> f32


@gpu_compile
def test_the_cli_says_a_config_does_not_fit_80_gb_and_writes_its_report(tmp_path):
    def compile_for(*overrides):
        return subprocess.run(
            [sys.executable, "-m", "train", str(GPT2_SMALL), "--compile-for", "h100", f"workdir={tmp_path}",
             "model.num_layers=2", "model.d_model=256", "model.num_heads=4", "data.batch_size=4096",
             "data.num_test=2048", *overrides], capture_output=True, text=True, env=subprocess_env(), cwd=ROOT,
            timeout=600)

    # 4096 x 1024 tokens: the whole logits alone are 790 GiB in float32; in blocks of rows (auto) it fits
    fits = compile_for()
    assert fits.returncode == 0 and "fits" in fits.stdout and "Blockwise loss: head logits [4096, 1024, 50304]" \
        in fits.stdout, fits.stdout[-3000:] + fits.stderr[-2000:]
    assert json.loads((tmp_path / "compiled-h100.json").read_text())["blockwise_loss"]["found"] is True
    result = compile_for("precision.blockwise_loss=false")
    assert result.returncode == 1, result.stderr[-2000:]
    assert "DOES NOT FIT" in result.stdout and "79.1 GiB" in result.stdout
    report = json.loads((tmp_path / "compiled-h100.json").read_text())
    assert report["fits"] is False and report["memory"]["peak"] > report["device_memory_bytes"]
    modeled = report["modeled"]  # the step's modeled time, said to be a model, with its top kernels
    assert "not a measurement" in modeled["what"] and modeled["seconds"] > 0 and len(modeled["top"]) == 10
    assert "Modeled step time on NVIDIA H100" in result.stdout and "not a measurement" in result.stdout


@gpu_compile
def test_the_compiled_benchmark_writes_its_table(tmp_path):
    from benchmarks import compiled

    assert compiled.main(["--models", "mlp", "--policies", "mixed_bf16,mixed_fp8", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "h100-compiled.json").read_text())["rows"]
    assert [r["policy"] for r in rows] == ["fp32", "mixed_bf16", "mixed_fp8"]  # fp32: the baseline
    assert rows[0]["f32_gemms"] == rows[0]["gemms"] > 0 and rows[1]["half_gemms"] == rows[1]["gemms"]
    assert rows[2]["fp8_gemms"] == rows[2]["gemms"]
    assert "| mlp | mixed_bf16 |" in (tmp_path / "h100-compiled.md").read_text()


@gpu_compile
def test_the_fused_attention_benchmark_writes_its_table(tmp_path):
    from benchmarks import fused_attention

    argv = ["--layers", "1", "--models", "hf_llama", "--cases", "mixed_bf16", "--out", str(tmp_path)]
    assert fused_attention.main(argv) == 0
    (row,) = json.loads((tmp_path / "h100-fused-attention.json").read_text())["rows"]
    assert row["cudnn_attention"] == row["cudnn_attention_backward"] == 1 and row["f32_gemms"] == 0
    assert "| hf_llama | mixed_bf16 |" in (tmp_path / "h100-fused-attention.md").read_text()


@gpu_compile
@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_every_shipped_config_and_user_model_compiles_for_an_h100_with_its_policy_kept(path, tmp_path):
    """On tiny stand-ins for the data CI lacks; shapes, not values, are compiled."""
    config = load_config(path)
    overrides = [f"workdir={tmp_path}"]
    if config.data.name == "fashion_mnist":
        overrides.append(f"data.path={tiny_fashion_mnist(tmp_path)}")
    elif config.data.name == "shakespeare":
        (tmp_path / "plays.txt").write_text(TINY_TEXT * 20)
        overrides.append(f"data.path={tmp_path / 'plays.txt'}")
    report = compile_for(load_config(path, overrides), "h100")
    assert report.fits and report.count() > 0
    if report.policy_half:
        assert report.f32_gemms() == {}, report.f32_gemms()
        assert all(set(k.operands) <= {"bf16", "f16", "f8e4m3fn", "f8e5m2"} for k in report.kernels
                   if k.kind == "cudnn_conv"), report.kernel_rows()


#: Users' models at the GPT-2-small layer shape (16 x 1024 tokens, 768 wide, 12 heads), two layers
#: and a small vocabulary, so attention, not the head, dominates memory.
LAYER_SHAPE = ("data.seq_len=1024", "data.batch_size=16", "data.num_classes=1024", "data.num_test=65536",
               "model.width=768", "model.heads=12", "model.layers=2", "model.max_len=1024")
USER = ROOT / "examples" / "user_models"
WRITTEN_OUT = {  # model: (config, overrides, its attention modules)
    "linen SelfAttention GPT": ("linen_gpt.yaml", (), ["block_0/attn", "block_1/attn"]),
    "HF-style GPT-2": ("hf_style.yaml", (), ["h_0_attn", "h_1_attn"]),
    "HF-style Llama": ("hf_style.yaml", ("model.name=hf_style.py:Llama",),
                       ["layers_0_self_attn", "layers_1_self_attn"]),
    "NNX MultiHeadAttention": ("nnx_lm.yaml", ("model.vocab_size=1024",), ["blocks/0/attn", "blocks/1/attn"]),
}


@gpu_compile
@pytest.mark.parametrize("name", WRITTEN_OUT)
def test_users_attention_compiles_to_cudnn_fused_attention_in_every_layer_at_a_third_of_the_memory(name):
    config, overrides, modules = WRITTEN_OUT[name]
    fp32 = _compiled(USER / "linen_gpt.yaml", *LAYER_SHAPE, "precision.policy=fp32")
    for policy in ("mixed_bf16",):  # float16 takes the same path (the GPT-2-small test above compiles both)
        report = _compiled(USER / config, *LAYER_SHAPE, *overrides, f"precision.policy={policy}")
        for kind in ("cudnn_attention", "cudnn_attention_backward"):
            calls = [k for k in report.kernels if k.kind == kind]
            assert sorted(k.module for k in calls) == modules, (kind, report.kernel_rows())
            assert all(set(k.operands) == {"bf16"} for k in calls)
        assert report.f32_gemms() == {}
        assert report.memory["temp"] <= 0.35 * fp32.memory["temp"], (report.memory, fp32.memory)
    if name == "linen SelfAttention GPT":  # fusion off: XLA's attention, materialised logits
        off = _compiled(USER / config, *LAYER_SHAPE, "precision.policy=mixed_bf16", "precision.fuse_attention=false")
        assert off.count("cudnn_attention") == 0 and off.memory["temp"] > 0.45 * fp32.memory["temp"]


@gpu_compile
def test_the_gpt_picks_cudnn_for_the_target_when_it_runs_in_half_itself():
    """The model's own choice (dtype=bfloat16, no autocast) follows the lowering's platform too."""
    from train.models import GPT

    gpt = GPT(vocab_size=64, block_size=128, num_layers=1, num_heads=2, d_model=128, dtype=jnp.bfloat16)
    tokens = jnp.zeros((2, 128), jnp.int32)
    params = jax.eval_shape(lambda: gpt.init(jax.random.key(0), tokens))
    sharding = jax.sharding.SingleDeviceSharding(target_devices(get_target("h100"))[0])
    place = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)  # noqa: E731
    grad = jax.jit(jax.grad(lambda p, t: gpt.apply(p, t).astype(jnp.float32).mean()))
    kernels = read_kernels(grad.lower(jax.tree_util.tree_map(place, params), place(tokens)).compile().as_text())
    assert {k.kind for k in kernels} >= {"cudnn_attention", "cudnn_attention_backward"}
    cpu = jax.jit(jax.grad(lambda p, t: gpt.apply(p, t).astype(jnp.float32).mean())).lower(
        jax.tree_util.tree_map(lambda x: jnp.zeros(x.shape, x.dtype), params), tokens).compile().as_text()
    assert "__cudnn$" not in cpu and " dot(" in cpu  # the same function lowered for this CPU: XLA's attention


# ----------------------------------------------------------------------------- everywhere


def test_without_the_cuda_plugin_compile_for_names_what_to_install(tmp_path):
    if _plugin():
        pytest.skip("JAX's CUDA plugin is installed here")
    result = subprocess.run([sys.executable, "-m", "train", "configs/default.yaml", "--compile-for", "h100",
                             f"workdir={tmp_path}"], capture_output=True, text=True, env=subprocess_env(), cwd=ROOT,
                            timeout=300)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.count("\n") == 1 and "pip install '.[gpu-compile]'" in result.stderr


@pytest.mark.parametrize("argv,message", [
    (["--compile-for", "b200"], "unknown compile target 'b200': give one of h100, h200, a100"),
    (["--devices", "2"], "--devices goes with --compile-for"),
    (["--mesh", "dat=2", "--compile-for", "h100"], "--mesh 'dat=2': give data=D,fsdp=F"),
])
def test_compile_for_flags_that_cannot_work_get_one_line(argv, message, tmp_path, capsys):
    from train.cli import main

    code = main(["configs/default.yaml", *argv, f"workdir={tmp_path}"])
    err = capsys.readouterr().err
    assert code == 2 and message in err and err.count("\n") == 1


def test_a_user_target_file_is_read_for_its_memory_and_name(tmp_path):
    text = get_target("h100").config_text.replace("84942979072", "25769803776").replace("H100 80GB HBM3", "Mine")
    path = tmp_path / "mine.txtpb"
    path.write_text(text)
    target = get_target(str(path))
    assert (target.name, target.device_kind, target.memory_bytes) == ("mine.txtpb", "NVIDIA Mine", 24 * 2 ** 30)
    (tmp_path / "bad.txtpb").write_text("platform_name: \"CUDA\"\n")
    with pytest.raises(TargetError, match="no gpu_device_info.device_memory_size"):
        get_target(str(tmp_path / "bad.txtpb"))
    assert get_target("H200").memory_bytes > get_target("h100").memory_bytes


# A compiled H100 program, cut to what the reader needs (written for this test).
_HLO = """\
HloModule jit_step, is_scheduled=true

%gemm_fusion_dot_computation (parameter_0: bf16[64,32], parameter_1: f32[32,16]) -> bf16[64,16] {
  %parameter_0 = bf16[64,32]{1,0} parameter(0)
  %parameter_1 = f32[32,16]{1,0} parameter(1)
  %convert.1 = bf16[32,16]{1,0} convert(%parameter_1)
  ROOT %dot.1 = bf16[64,16]{1,0} dot(%parameter_0, %convert.1), lhs_contracting_dims={1}, rhs_contracting_dims={0}, metadata={op_name="jit(step)/jvp(M)/precision.module=/enc/precision.module=enc/dense/dot_general"}
}

%gemm_fusion_dot.2_computation (parameter_0.2: f32[64,32], parameter_1.2: f32[32,16]) -> f32[64,16] {
  %parameter_0.2 = f32[64,32]{1,0} parameter(0)
  %parameter_1.2 = f32[32,16]{1,0} parameter(1)
  ROOT %dot.2 = f32[64,16]{1,0} dot(%parameter_0.2, %parameter_1.2), lhs_contracting_dims={1}, rhs_contracting_dims={0}, metadata={op_name="jit(step)/transpose(jvp(M))/precision.module=/head/precision:float32/precision.module=head/dot_general"}
}

ENTRY %main.9 (p0: bf16[64,32], p1: f32[32,16], q: bf16[2,8,4,64], x: f8e4m3fn[16,32], y: f8e4m3fn[32,16]) -> bf16[64,16] {
  %p0 = bf16[64,32]{1,0} parameter(0)
  %p1 = f32[32,16]{1,0} parameter(1)
  %q = bf16[2,8,4,64]{3,2,1,0} parameter(2)
  %x = f8e4m3fn[16,32]{1,0} parameter(3)
  %y = f8e4m3fn[32,16]{1,0} parameter(4)
  %gemm_fusion_dot = bf16[64,16]{1,0} fusion(%p0, %p1), kind=kCustom, calls=%gemm_fusion_dot_computation, backend_config={"fusion_backend_config":{"kind":"__triton_nested_gemm_fusion"}}
  %convert.3 = f32[64,32]{1,0} convert(%p0)
  %gemm_fusion_dot.2 = f32[64,16]{1,0} fusion(%convert.3, %p1), kind=kCustom, calls=%gemm_fusion_dot.2_computation, backend_config={"fusion_backend_config":{"kind":"__triton_gemm"}}
  %attn = (bf16[2,4,8,64]{3,1,2,0}, f32[2,4,8]{2,1,0}, u8[0]{0}) custom-call(%q, %q, %q), custom_call_target="__cudnn$fmhaSoftmax", metadata={op_name="jit(step)/precision.module=/blk%2F0/precision.module=blk%2F0/attn/jit(dot_product_attention)/cudnn"}
  %f8 = (bf16[16,16]{1,0}, s8[0]{0}) custom-call(%x, %y), custom_call_target="__cublas$lt$matmul$f8", metadata={op_name="jit(step)/mlp/dot_general"}
  ROOT %out = bf16[64,16]{1,0} add(%gemm_fusion_dot, %gemm_fusion_dot)
}
"""


def test_the_reader_finds_each_kernel_with_its_operand_dtypes_module_and_region():
    kernels = {k.kind: k for k in read_kernels(_HLO)}
    assert set(kernels) == {"triton_gemm", "cudnn_attention", "cublaslt_fp8"}
    gemms = [k for k in read_kernels(_HLO) if k.kind == "triton_gemm"]
    assert [(k.operands, k.module, k.region) for k in gemms] == [
        (("bf16", "bf16"), "enc/dense", ""), (("f32", "f32"), "head", "float32")]  # the convert is in the kernel
    assert kernels["cudnn_attention"].operands == ("bf16",) * 3 and kernels["cudnn_attention"].module == "blk/0/attn"
    assert kernels["cublaslt_fp8"].fp8 and kernels["cublaslt_fp8"].module == "mlp"
    assert not gemms[0].has_f32_operand and gemms[1].has_f32_operand and not gemms[1].fp8
    assert module_of("jit(f)/a/b/cond/branch_0_fun/c/checkpoint/dot_general") == "a/b/c" and region_of("x/precision:bfloat16/y") == "bfloat16"


# ----------------------------------------------------------------------------- the choice by platform, on this CPU


def test_a_platform_choice_is_read_once_by_explain_and_probed_op_by_op_by_the_doctor():
    """A program holding ``jax.lax.platform_dependent`` (cuDNN's attention for CUDA, another
    one elsewhere) counts the portable branch's matmuls once, and the doctor runs the
    branch this machine takes, op by op."""

    class Mixed(nn.Module):
        @nn.compact
        def __call__(self, x):
            y = nn.Dense(16)(x)
            y = jax.lax.platform_dependent(y, cuda=lambda y: y @ jnp.eye(16, dtype=y.dtype) * 2.0,
                                           default=lambda y: jnp.tanh(y) @ jnp.eye(16, dtype=y.dtype))
            return nn.Dense(4)(y)

    x = jnp.ones((8, 32))
    explanation = precision.explain(Mixed(), x, policy="mixed_bf16")
    assert explanation.forward[1] == 2 * 8 * (32 * 16 + 16 * 16 + 16 * 4)  # one branch's matmul, not two
    model = precision.with_policy(Mixed(), "mixed_bf16")
    params = model.init(jax.random.key(0), x)
    _, probes, _ = probe.run(lambda p: model.apply(p, x), (params,))
    assert "tanh" in {p.primitive for p in probes} and "cond" not in {p.primitive for p in probes}
    assert precision.diagnose(Mixed(), x, policy="mixed_bf16", loss_fn=lambda out: out.astype(jnp.float32).mean()
                              ).healthy
