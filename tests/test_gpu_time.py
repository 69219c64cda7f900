"""The kernels of a compiled program with their bytes and FLOPs, and the modeled GPU step time.

These run everywhere (no CUDA plugin): the reader is checked on a GPU-style HLO
module written here and on programs XLA:CPU compiles; the model on its own
arithmetic. The H100 programs themselves are read by ``tests/test_step_cost.py``.
"""

import re

import jax
import jax.numpy as jnp
import pytest

from train.inspections.gpu_time import CALIBRATION, Calibration, datasheet, model_kernels, model_step
from train.inspections.hlo_kernels import HloKernel, read_hlo_kernels
from train.inspections.targets import get_target

# A GPU-style optimized module: a Triton GEMM fusion, a cuBLAS call, cuDNN attention forward, an
# elementwise fusion that slices its operand, one that gathers rows of an elementwise result, one that
# updates a buffer in place, a reduction, and a loop of 3 iterations around an elementwise fusion;
# views and tuples launch nothing.
HLO = """HloModule jit_step, is_scheduled=true

%gemm_comp (p0: bf16[64,128], p1: bf16[128,256]) -> bf16[64,256] {
  %p0 = bf16[64,128]{1,0} parameter(0)
  %p1 = bf16[128,256]{1,0} parameter(1)
  ROOT %dot.1 = bf16[64,256]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%slice_comp (q0: f32[1000,16]) -> f32[10,16] {
  %q0 = f32[1000,16]{1,0} parameter(0)
  %slice.1 = f32[10,16]{1,0} slice(%q0), slice={[0:10], [0:16]}
  ROOT %negate.1 = f32[10,16]{1,0} negate(%slice.1)
}

%gather_comp (g0: bf16[1000,16], g1: bf16[16], g2: s32[10,1]) -> f32[10,16] {
  %g0 = bf16[1000,16]{1,0} parameter(0)
  %g1 = bf16[16]{0} parameter(1)
  %g2 = s32[10,1]{1,0} parameter(2)
  %bias = bf16[1000,16]{1,0} broadcast(%g1), dimensions={1}
  %sum = bf16[1000,16]{1,0} add(%g0, %bias)
  %rows = bf16[10,16]{1,0} gather(%sum, %g2), offset_dims={1}, collapsed_slice_dims={0}, start_index_map={0}, index_vector_dim=1, slice_sizes={1,16}
  ROOT %wide = f32[10,16]{1,0} convert(%rows)
}

%dus_comp (r0: f32[1000,16], r1: f32[10,16], r2: s32[]) -> f32[1000,16] {
  %r0 = f32[1000,16]{1,0} parameter(0)
  %r1 = f32[10,16]{1,0} parameter(1)
  %r2 = s32[] parameter(2)
  %zero = s32[] constant(0)
  ROOT %dus.1 = f32[1000,16]{1,0} dynamic-update-slice(%r0, %r1, %r2, %zero)
}

%add_comp (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %add.9 = f32[] add(%a, %b)
}

%reduce_comp (s0: f32[64,256]) -> f32[64] {
  %s0 = f32[64,256]{1,0} parameter(0)
  %c0 = f32[] constant(0)
  ROOT %reduce.1 = f32[64]{0} reduce(%s0, %c0), dimensions={1}, to_apply=%add_comp
}

%tanh_comp (t0: f32[64,256]) -> f32[64,256] {
  %t0 = f32[64,256]{1,0} parameter(0)
  ROOT %tanh.1 = f32[64,256]{1,0} tanh(%t0)
}

%body (loop: (s32[], f32[64,256])) -> (s32[], f32[64,256]) {
  %loop = (s32[], f32[64,256]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%loop), index=0
  %x = f32[64,256]{1,0} get-tuple-element(%loop), index=1
  %loop_tanh_fusion = f32[64,256]{1,0} fusion(%x), kind=kLoop, calls=%tanh_comp
  ROOT %t = (s32[], f32[64,256]{1,0}) tuple(%i, %loop_tanh_fusion)
}

%cond (c: (s32[], f32[64,256])) -> pred[] {
  %c = (s32[], f32[64,256]{1,0}) parameter(0)
  ROOT %lt = pred[] constant(true)
}

ENTRY %main (x: bf16[64,128], w: bf16[128,256], big: f32[1000,16], q: bf16[2,8,128,64], i: s32[], f: f32[64,256], h: bf16[1000,16], hb: bf16[16], ix: s32[10,1]) -> f32[64] {
  %x = bf16[64,128]{1,0} parameter(0)
  %w = bf16[128,256]{1,0} parameter(1)
  %big = f32[1000,16]{1,0} parameter(2)
  %q = bf16[2,8,128,64]{3,2,1,0} parameter(3)
  %i = s32[] parameter(4)
  %f = f32[64,256]{1,0} parameter(5)
  %h = bf16[1000,16]{1,0} parameter(6)
  %hb = bf16[16]{0} parameter(7)
  %ix = s32[10,1]{1,0} parameter(8)
  %loop_gather_fusion = f32[10,16]{1,0} fusion(%h, %hb, %ix), kind=kLoop, calls=%gather_comp
  %gemm_fusion_dot.7 = bf16[64,256]{1,0} fusion(%x, %w), kind=kCustom, calls=%gemm_comp, metadata={op_name="jit(step)/jvp(Model)/dense/dot_general"}, backend_config={"fusion_backend_config":{"kind":"__triton_gemm"}}
  %custom-call.3 = (bf16[64,256]{1,0}, s8[4194304]{0}) custom-call(%x, %w), custom_call_target="__cublas$gemm", backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"]}}}
  %fmha.1 = (bf16[2,8,128,64]{3,2,1,0}, f32[2,8,128]{2,1,0}, u8[0]{0}) custom-call(%q, %q, %q), custom_call_target="__cudnn$fmhaSoftmax", backend_config={"cudnn_fmha_backend_config": {"intermediate_tensor_shape": {"element_type": "BF16", "dimensions": ["2", "8", "128", "128"]}, "mask_type": "CAUSAL"}}
  %loop_negate_fusion = f32[10,16]{1,0} fusion(%big), kind=kLoop, calls=%slice_comp
  %dus_fusion = f32[1000,16]{1,0} fusion(%big, %loop_negate_fusion, %i), kind=kLoop, calls=%dus_comp
  %input_reduce_fusion = f32[64]{0} fusion(%f), kind=kInput, calls=%reduce_comp
  %zero_i = s32[] constant(0)
  %init = (s32[], f32[64,256]{1,0}) tuple(%zero_i, %f)
  %while.1 = (s32[], f32[64,256]{1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  %view = f32[16,1000]{0,1} bitcast(%dus_fusion)
  ROOT %copy.1 = f32[64]{0} copy(%input_reduce_fusion)
}
"""


def _by_name():
    return {k.name: k for k in read_hlo_kernels(HLO)}


def test_the_reader_lists_every_kernel_once_per_launch_and_nothing_for_views_tuples_and_loops():
    kernels = _by_name()
    assert set(kernels) == {"gemm_fusion_dot.7", "custom-call.3", "fmha.1", "loop_negate_fusion", "dus_fusion",
                            "input_reduce_fusion", "loop_tanh_fusion", "copy.1", "loop_gather_fusion"}
    assert kernels["loop_tanh_fusion"].launches == 3  # the loop body, once per iteration
    assert {k: v.kind for k, v in kernels.items()} == {
        "gemm_fusion_dot.7": "gemm", "custom-call.3": "gemm", "fmha.1": "attention", "loop_negate_fusion": "fusion",
        "dus_fusion": "fusion", "input_reduce_fusion": "reduction", "loop_tanh_fusion": "fusion", "copy.1": "copy",
        "loop_gather_fusion": "fusion"}
    assert kernels["gemm_fusion_dot.7"].module == "dense"


def test_the_reader_counts_gemm_and_attention_flops_and_the_bytes_a_kernel_must_move():
    k = _by_name()
    gemm_bytes = 2 * (64 * 128 + 128 * 256 + 64 * 256)
    for name in ("gemm_fusion_dot.7", "custom-call.3"):  # cuBLAS's workspace is no traffic
        assert k[name].flops == 2 * 64 * 128 * 256 and k[name].bytes == gemm_bytes and k[name].dtype == "bf16"
    attention = k["fmha.1"]
    assert attention.flops == 2 * 2 * (2 * 8 * 128 * 128) * 64 and attention.causal  # two products
    assert k["loop_negate_fusion"].bytes == 2 * 10 * 16 * 4  # reads only the slice it takes
    # a gather after elementwise ops (a label's logit of logits + bias) computes only the rows it takes
    assert k["loop_gather_fusion"].bytes == 10 * 16 * 2 + 16 * 2 + 10 * 4 + 10 * 16 * 4
    assert k["dus_fusion"].bytes == 10 * 16 * 4 + 4 + 10 * 16 * 4  # in place: the update read and written
    assert k["input_reduce_fusion"].bytes == 4 * (64 * 256 + 64)


def test_loops_count_their_kernels_once_per_iteration_in_a_program_xla_compiled():
    def scanned(x, w):
        return jax.lax.scan(lambda c, _: (jnp.tanh(c @ w), None), x, None, length=5)[0].sum()

    text = jax.jit(scanned).lower(jnp.ones((64, 128)), jnp.ones((128, 128))).compile().as_text()
    kernels = read_hlo_kernels(text)
    gemms = [k for k in kernels if k.flops]
    assert sum(k.launches * k.flops for k in gemms) == 5 * 2 * 64 * 128 * 128, gemms
    assert all(k.launches == 5 for k in gemms)


def test_the_h100_and_h200_datasheets_are_read_from_their_target_descriptions():
    h100, h200 = datasheet(get_target("h100")), datasheet(get_target("h200"))
    assert h100.half == pytest.approx(989.4e12, rel=1e-3) and h100.fp8 == pytest.approx(2 * h100.half)
    assert h100.tf32 == pytest.approx(h100.half / 2) and h100.f32 == pytest.approx(66.9e12, rel=1e-3)
    assert h100.bandwidth == pytest.approx(3.35e12, rel=1e-3) and h200.bandwidth == pytest.approx(4.8e12)
    assert h100.peak("bf16") == h100.half and h100.peak("f8e4m3fn") == h100.fp8
    assert h100.peak("f32") == h100.tf32 and h100.peak("f32", "highest") == h100.f32


def test_a_target_without_a_datasheet_is_refused_with_its_compute_capability():
    target = get_target("h100")
    text = target.config_text.replace("major: 9 minor: 0", "major: 7 minor: 5")
    with pytest.raises(ValueError, match=r"compute capability \(7, 5\)"):
        datasheet(type(target)("t4", "T4", 1, text))


def test_each_kernel_takes_its_latency_and_bytes_or_its_flops_plus_the_gap():
    sheet = datasheet(get_target("h100"))
    c = Calibration(gemm_efficiency=0.5, attention_efficiency=0.25, bandwidth_efficiency=0.5,
                    min_kernel_seconds=2e-6, gap_seconds=1e-6, source="test")
    memory = HloKernel("m", "fusion", 2, 3.35e9, 0.0, "f32", "")  # 1 GB/ms at half the bandwidth: 2 ms a launch
    compute = HloKernel("g", "gemm", 1, 1e3, 989.4e12 * 1e-3, "bf16", "")  # 1 ms at peak, 2 ms at half
    causal = HloKernel("a", "attention", 1, 1e3, 2 * 989.4e12 * 1e-3, "bf16", "", causal=True)
    tiny = HloKernel("t", "fusion", 1, 8.0, 0.0, "f32", "")
    small = HloKernel("s", "reduction", 1, 3.35e6, 0.0, "f32", "")  # 2 us of bytes past 2 us of latency
    got = {m.kernel.name: m for m in model_kernels([memory, compute, causal, tiny, small], sheet, c)}
    assert got["m"].seconds == pytest.approx(2 * (2e-6 + 2e-3 + 1e-6), rel=1e-3) and got["m"].bound == "memory"
    assert got["g"].seconds == pytest.approx(2e-3 + 1e-6, rel=1e-3) and got["g"].bound == "compute"
    assert got["a"].seconds == pytest.approx(4e-3 + 1e-6, rel=1e-3)  # half the FLOPs (causal), a quarter of peak
    assert got["t"].seconds == pytest.approx(3e-6, rel=1e-5) and got["t"].bound == "launch"
    assert got["s"].seconds == pytest.approx(5e-6, rel=1e-3) and got["s"].bound == "launch"


def test_the_modeled_step_reports_its_kinds_and_top_kernels_and_says_it_is_a_model():
    step = model_step(HLO, get_target("h100"))
    assert step.launches == 11 and step.seconds == pytest.approx(sum(m.seconds for m in step.kernels))
    kinds = step.by_kind()
    assert kinds["fusion"]["launches"] == 6 and kinds["gemm"]["flops"] == 2 * 2 * 64 * 128 * 256
    report = step.to_json(top=3)
    assert "not a measurement" in report["what"] and len(report["top"]) == 3
    assert report["calibration"] == CALIBRATION._asdict()
    assert report["top"][0]["seconds"] == max(m.seconds for m in step.kernels)
    assert "not a measurement" in step.lines()[0]


def test_a_gpu_profile_carries_the_modeled_time_of_its_program_by_the_profiles_kinds():
    """benchmarks.profile_step puts the model beside what a lent H100/H200 measures: the
    calibration data of the next lease, for the program that ran."""
    from benchmarks.profile_step import modeled

    assert modeled(HLO, "cpu") is None and modeled(HLO, "NVIDIA A100-SXM4-80GB") is None
    found = modeled(HLO, "NVIDIA H200")
    assert "not a measurement" in found["what"] and found["launches"] == 11
    assert set(found["busy_by_kind"]) == {"gemm", "attention", "fusion", "reduction", "copy"}
    gap = CALIBRATION.gap_seconds * found["launches"]
    assert found["seconds"] == pytest.approx(sum(found["busy_by_kind"].values()) + gap)


def test_a_loop_carrying_six_or_more_values_counts_its_kernels_once_per_iteration():
    """XLA writes ``/*index=5*/`` inside a tuple of six or more: the loop is still read (the
    blockwise loss's scan carries a weight's gradient, the rows and the invariants)."""
    def scanned(x, w):
        def body(carry, _):
            a, b, c, d, e, f = carry
            return (jnp.tanh(a @ w), b + a[0, :3], c * a[1, :4], d - a[2, :5], e + a.sum(), f + b.sum()), None
        init = (x, jnp.ones(3), jnp.ones(4), jnp.ones(5), jnp.float32(0), jnp.float32(1))
        return sum(v.sum() for v in jax.lax.scan(body, init, None, length=4)[0])

    text = jax.jit(scanned).lower(jnp.ones((64, 128)), jnp.ones((128, 128))).compile().as_text()
    assert "/*index=5*/" in text
    gemms = [k for k in read_hlo_kernels(text) if k.flops]
    assert gemms and all(k.launches == 4 for k in gemms), gemms


def test_backend_configs_read_the_same_compact_or_spaced():
    """JAX writes a cuDNN attention's backend config with json.dumps' spaces; a GPU that compiled
    it prints it compact, as XLA prints every other config (the H200 of 2026-11-28 modeled its
    causal attention at twice the FLOPs: the mask went unread). Both read the same kernels."""
    compact = re.sub(r'":\s+', '":', re.sub(r",\s+", ",", HLO))
    spaced = re.sub(r'":(?=[\["{\d])', '": ', HLO)
    assert compact != HLO and spaced != HLO
    for text in (compact, spaced):
        assert {k.name: k for k in read_hlo_kernels(text)} == _by_name()
    assert _by_name()["fmha.1"].causal and _by_name()["loop_tanh_fusion"].launches == 3


def test_a_custom_calls_results_aliased_to_its_operands_are_moved_once():
    """A kernel updating buffers in place (the fused decode's attention writes its cache) reads them;
    its aliased results are the same memory, not bytes moved again (issue 70)."""
    text = """HloModule jit_step, is_scheduled=true

ENTRY %main (q: f32[1,64], k: bf16[1,512,2,16], v: bf16[1,512,2,16]) -> (f32[1,64], bf16[1,512,2,16], bf16[1,512,2,16]) {
  %q = f32[1,64]{1,0} parameter(0)
  %k = bf16[1,512,2,16]{3,2,1,0} parameter(1)
  %v = bf16[1,512,2,16]{3,2,1,0} parameter(2)
  ROOT %pallas_call.1 = (f32[1,64]{1,0}, bf16[1,512,2,16]{3,2,1,0}, bf16[1,512,2,16]{3,2,1,0}) custom-call(%q, %k, %v), custom_call_target="__gpu$xla.gpu.triton", output_to_operand_aliasing={{1}: (1, {}), {2}: (2, {})}, api_version=API_VERSION_TYPED_FFI
}
"""
    (kernel,) = read_hlo_kernels(text)
    cache = 512 * 2 * 16 * 2
    assert kernel.bytes == 64 * 4 + 2 * cache + 64 * 4  # q and the caches read, the output written
    single = text.replace("(f32[1,64], bf16[1,512,2,16], bf16[1,512,2,16]) {", "bf16[1,512,2,16] {").replace(
        "(f32[1,64]{1,0}, bf16[1,512,2,16]{3,2,1,0}, bf16[1,512,2,16]{3,2,1,0}) custom-call",
        "bf16[1,512,2,16]{3,2,1,0} custom-call").replace("{{1}: (1, {}), {2}: (2, {})}", "{{}: (1, {})}")
    (kernel,) = read_hlo_kernels(single)
    assert kernel.bytes == 64 * 4 + 2 * cache  # one result, the cache it updates
