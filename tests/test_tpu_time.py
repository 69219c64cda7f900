"""The modeled TPU step time: HBM bytes as a TPU program moves them (VMEM is not HBM, a prefetch
moves its bytes once), each op the longest of its HBM, matrix and XLA-estimated time, and the
bound a program's matmuls at twice the rate would reach.

These run everywhere: the reader is checked on a TPU-style optimized module written here (the
layouts, async copies and ``estimated_cycles`` libtpu writes; the full GPT-2-small programs are
in benchmarks/results/int8-compiled.md).
"""

import pytest

from train.inspections.gpu_time import CALIBRATION
from train.inspections.hlo_kernels import read_hlo_kernels
from train.inspections.int8_share import int8_share
from train.inspections.tpu_kernels import read_tpu_kernels
from train.inspections.tpu_time import (BANDWIDTH_EFFICIENCY, TPU_DATASHEETS, amdahl_bound, model_tpu_step, op_times,
                                        tpu_kernels, xla_cycles_by_op)

_CONFIG = '"estimated_cycles":"{}"'


def _cycles(n: int) -> str:
    return 'backend_config={"window_config":{' + _CONFIG.format(n) + '}}'


# A weight prefetched into VMEM in four slices and put back together there (ConcatBitcast), an
# activation prefetched whole (copy-start) and another evicted to HBM; a matmul reading both from
# VMEM and writing its result to HBM; an elementwise fusion whose operand and result stay in VMEM.
HLO = f"""HloModule jit_step, is_scheduled=true

%mm_comp (p0: bf16[1024,512], p1: bf16[512,2048]) -> bf16[1024,2048] {{
  %p0 = bf16[1024,512]{{1,0:T(8,128)(2,1)S(1)}} parameter(0)
  %p1 = bf16[512,2048]{{1,0:T(8,128)(2,1)S(1)}} parameter(1)
  ROOT %conv.1 = bf16[1024,2048]{{1,0:T(8,128)(2,1)}} convolution(%p0, %p1), dim_labels=bf_io->bf
}}

%vec_comp (v0: bf16[1024,512]) -> bf16[1024,512] {{
  %v0 = bf16[1024,512]{{1,0:T(8,128)(2,1)S(1)}} parameter(0)
  ROOT %exp.1 = bf16[1024,512]{{1,0:T(8,128)(2,1)S(1)}} exponential(%v0)
}}

ENTRY %main (w: bf16[512,2048], x: bf16[1024,512]) -> (bf16[1024,2048], bf16[1024,512]) {{
  %w = bf16[512,2048]{{1,0:T(8,128)(2,1)}} parameter(0)
  %x = bf16[1024,512]{{1,0:T(8,128)(2,1)}} parameter(1)
  %ss.0 = ((bf16[512,2048]{{1,0:T(8,128)(2,1)}}), bf16[128,2048]{{1,0:T(8,128)(2,1)S(1)}}, s32[]{{:S(2)}}) slice-start(%w), slice={{[0:128], [0:2048]}}
  %ss.1 = ((bf16[512,2048]{{1,0:T(8,128)(2,1)}}), bf16[128,2048]{{1,0:T(8,128)(2,1)S(1)}}, s32[]{{:S(2)}}) slice-start(%w), slice={{[128:256], [0:2048]}}
  %ss.2 = ((bf16[512,2048]{{1,0:T(8,128)(2,1)}}), bf16[128,2048]{{1,0:T(8,128)(2,1)S(1)}}, s32[]{{:S(2)}}) slice-start(%w), slice={{[256:384], [0:2048]}}
  %ss.3 = ((bf16[512,2048]{{1,0:T(8,128)(2,1)}}), bf16[128,2048]{{1,0:T(8,128)(2,1)S(1)}}, s32[]{{:S(2)}}) slice-start(%w), slice={{[384:512], [0:2048]}}
  %sd.0 = bf16[128,2048]{{1,0:T(8,128)(2,1)S(1)}} slice-done(%ss.0)
  %sd.1 = bf16[128,2048]{{1,0:T(8,128)(2,1)S(1)}} slice-done(%ss.1)
  %sd.2 = bf16[128,2048]{{1,0:T(8,128)(2,1)S(1)}} slice-done(%ss.2)
  %sd.3 = bf16[128,2048]{{1,0:T(8,128)(2,1)S(1)}} slice-done(%ss.3)
  %w.vmem = bf16[512,2048]{{1,0:T(8,128)(2,1)S(1)}} custom-call(%sd.0, %sd.1, %sd.2, %sd.3), custom_call_target="ConcatBitcast"
  %cs.0 = (bf16[1024,512]{{1,0:T(8,128)(2,1)S(1)}}, bf16[1024,512]{{1,0:T(8,128)(2,1)}}, u32[]{{:S(2)}}) copy-start(%x)
  %x.vmem = bf16[1024,512]{{1,0:T(8,128)(2,1)S(1)}} copy-done(%cs.0)
  %mm = bf16[1024,2048]{{1,0:T(8,128)(2,1)}} fusion(%x.vmem, %w.vmem), kind=kOutput, calls=%mm_comp, {_cycles(1_000_000)}
  %e = bf16[1024,512]{{1,0:T(8,128)(2,1)S(1)}} fusion(%x.vmem), kind=kLoop, calls=%vec_comp, {_cycles(300_000)}
  %cs.1 = (bf16[1024,512]{{1,0:T(8,128)(2,1)}}, bf16[1024,512]{{1,0:T(8,128)(2,1)S(1)}}, u32[]{{:S(2)}}) copy-start(%e)
  %e.hbm = bf16[1024,512]{{1,0:T(8,128)(2,1)}} copy-done(%cs.1)
  ROOT %out = (bf16[1024,2048]{{1,0:T(8,128)(2,1)}}, bf16[1024,512]{{1,0:T(8,128)(2,1)}}) tuple(%mm, %e.hbm)
}}
"""

W, X, Y = 512 * 2048 * 2, 1024 * 512 * 2, 1024 * 2048 * 2  # bytes of the weight, the activation, the result


def _bytes() -> dict[str, float]:
    return {k.name: k.bytes for k in read_hlo_kernels(HLO)}


def test_a_prefetch_into_vmem_moves_its_bytes_once_and_what_stays_in_vmem_moves_none():
    moved = _bytes()
    assert [moved[f"ss.{i}"] for i in range(4)] == [W / 4] * 4  # each slice read once, not the whole weight twice
    assert moved["cs.0"] == X and moved["cs.1"] == X  # a prefetch reads HBM once, an eviction writes it once
    assert moved["w.vmem"] == 0  # slices put back together in VMEM
    assert moved["e"] == 0  # an exp of a value in VMEM into VMEM
    assert moved["mm"] == Y  # its operands in VMEM, its result to HBM
    assert sum(moved.values()) == W + 2 * X + Y


def test_each_op_takes_the_longest_of_its_hbm_matrix_and_xla_estimated_times():
    sheet, e_bw, e_mxu = TPU_DATASHEETS["v5e"], BANDWIDTH_EFFICIENCY, CALIBRATION.gemm_efficiency
    assert xla_cycles_by_op(HLO) == {"mm": 1_000_000, "e": 300_000}
    step = model_tpu_step(HLO, "v5e")
    flops = 2 * 1024 * 512 * 2048
    assert step.matmul_flops == {"bf16": flops} and step.hbm_bytes == W + 2 * X + Y
    mm = max(Y / (sheet.bandwidth * e_bw), flops / (sheet.bf16 * e_mxu), 1_000_000 / sheet.clock)
    assert mm == 1_000_000 / sheet.clock  # XLA's estimate is the longest here: the op is bound by it
    assert step.vector_seconds == pytest.approx(mm + 300_000 / sheet.clock)  # the exp: no HBM bytes, its cycles
    assert step.memory_seconds == pytest.approx((W + 2 * X) / (sheet.bandwidth * e_bw))
    assert step.seconds == pytest.approx(step.memory_seconds + step.vector_seconds)
    assert "vector-bound (XLA's estimate)" in "\n".join(step.lines())


def test_the_amdahl_bound_halves_only_the_matmuls_matrix_time():
    step = model_tpu_step(HLO, "v5e")
    faster = model_tpu_step(HLO, "v5e", matmul_speedup=2.0)
    sheet, flops = TPU_DATASHEETS["v5e"], 2 * 1024 * 512 * 2048
    estimate = 1_000_000 / sheet.clock - flops / sheet.bf16 / 2  # its fused work as it was, its FLOPs at twice the peak
    assert faster.seconds == pytest.approx(step.seconds - 1_000_000 / sheet.clock + estimate)
    assert amdahl_bound(HLO, "v5e") == pytest.approx(faster.seconds / step.seconds)
    assert 0.5 < amdahl_bound(HLO, "v5e") < 1.0


def test_op_times_name_each_ops_bound_and_sum_to_the_step_and_the_rooflines_alone_drop_xlas_estimates():
    ops = {op.kernel.name: op for op in op_times(HLO, "v5e")}
    assert ops["mm"].bound == "xla" and ops["e"].bound == "xla" and ops["cs.0"].bound == "hbm"
    assert sum(op.seconds for op in ops.values()) == pytest.approx(model_tpu_step(HLO, "v5e").seconds)
    rooflines = {op.kernel.name: op for op in op_times(HLO, "v5e", xla_estimates=False)}
    assert rooflines["e"].seconds == 0.0  # the exp moves no HBM bytes and has no matmul: only XLA's estimate timed it
    assert rooflines["mm"].bound in ("matrix", "hbm") and rooflines["mm"].seconds < ops["mm"].seconds
    roofline_step = model_tpu_step(HLO, "v5e", xla_estimates=False)
    assert roofline_step.seconds == pytest.approx(sum(op.seconds for op in rooflines.values()))
    assert 0.5 < amdahl_bound(HLO, "v5e", xla_estimates=False) < 1.0


# An int8 matmul kernel (precision.autocast.scaled.int8_pallas) as libtpu writes its custom call: the
# 16-bit activation and the int8 weight in, its FLOPs and HBM bytes in the cost_estimate it declares.
KERNEL_HLO = """HloModule jit_step, is_scheduled=true

ENTRY %main (x: bf16[4096,1024], w: s8[1024,4096], s: f32[1,4096]) -> bf16[4096,4096] {
  %x = bf16[4096,1024]{1,0:T(8,128)(2,1)} parameter(0)
  %w = s8[1024,4096]{1,0:T(8,128)(4,1)} parameter(1)
  %s = f32[1,4096]{1,0:T(1,128)} parameter(2)
  ROOT %int8_rows_matmul.1 = bf16[4096,4096]{1,0:T(8,128)(2,1)} custom-call(%x, %w, %s), \
custom_call_target="tpu_custom_call", metadata={op_name="jit(step)/block_0/Dense_0/cond/branch_0_fun/\
int8_pallas_matmul/int8_rows_matmul/pallas_call"}, backend_config={"custom_call_config":{"body":"TUzv",\
"cost_estimate":{"flops":"34359738368","transcendentals":"0","bytes_accessed":"50000000",\
"remote_bytes_transferred":"0"}}}
}
"""


def test_an_int8_kernel_is_an_int8_matmul_timed_by_its_cost_estimate():
    (op,) = op_times(KERNEL_HLO, "v5e")
    sheet = TPU_DATASHEETS["v5e"]
    assert (op.kernel.kind, op.kernel.dtype, op.kernel.module) == ("gemm", "s8", "block_0/Dense_0")
    assert op.kernel.flops == 2 * 4096 * 1024 * 4096 and op.kernel.bytes == 50e6  # declared, not its operands'
    matrix = op.kernel.flops / (sheet.int8 * CALIBRATION.gemm_efficiency)
    assert op.bound == "matrix" and op.seconds == pytest.approx(matrix)
    assert int8_share(tpu_kernels(KERNEL_HLO)).share == 1.0
    (kernel,) = read_tpu_kernels(KERNEL_HLO)
    assert (kernel.kind, kernel.operands, kernel.result) == ("tpu_matmul", ("s8", "s8"), "s32")


# The splash attention's backward dq kernel (precision.autocast.tpu_splash) as libtpu writes its custom call: its
# kernel_metadata attribute holds line breaks, the instruction's metadata after them.
SPLASH_HLO = """HloModule jit_step, is_scheduled=true

ENTRY %main (q: bf16[16,12,1024,64], d: f32[16,12,8,1024]) -> bf16[16,12,1024,64] {
  %q = bf16[16,12,1024,64]{3,2,1,0:T(8,128)(2,1)} parameter(0)
  %d = f32[16,12,8,1024]{3,2,1,0:T(8,128)} parameter(1)
  ROOT %splash_mha_dq_no_residuals.3 = bf16[16,12,1024,64]{3,2,1,0:T(8,128)(2,1)} custom-call(%q, %q, %q, %d, %q), \
custom_call_target="tpu_custom_call", frontend_attributes={kernel_metadata={
"xprof_metadata":"{\\"block_q\\": 512, \\"block_kv\\": 512}"
}}, metadata={op_name="jit(step)/precision.module=/block_3/precision.module=block_3/attn/pallas_flash_attention_bwd/\
vmap(one)/splash_mha_dq_no_residuals/pallas_call"}, backend_config={"custom_call_config":{"body":"TUzv"}}
}
"""


def test_a_splash_kernel_written_over_several_lines_is_one_attention_op_of_its_module():
    (op,) = op_times(SPLASH_HLO, "v5e")
    assert (op.kernel.kind, op.kernel.module) == ("attention", "block_3/attn")
    assert op.kernel.flops == 2 * 3 * 16 * 12 * 1024 * 1024 * 64 and op.kernel.causal  # dq: three products, causal
    assert op.kernel.bytes == 4 * 16 * 12 * 1024 * 64 * 2 + 16 * 12 * 8 * 1024 * 4 + 16 * 12 * 1024 * 64 * 2
    (kernel,) = read_tpu_kernels(SPLASH_HLO)
    assert (kernel.kind, kernel.module) == ("tpu_flash_attention_backward", "block_3/attn")


# A scan over 12 layers as XLA:TPU writes its loop: no known_trip_count (XLA:GPU writes one), the
# condition comparing the counter (tuple element 0, from 0) with a constant.
SCAN_HLO = """HloModule jit_step, is_scheduled=true

%body (p: (s32[], bf16[4096,1024])) -> (s32[], bf16[4096,1024]) {
  %p = (s32[], bf16[4096,1024]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %x = bf16[4096,1024]{1,0} get-tuple-element(%p), index=1
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  %layer = bf16[4096,1024]{1,0} fusion(%x), kind=kLoop, calls=%tanh, metadata={op_name="jit(step)/while/body/tanh"}
  ROOT %t = (s32[], bf16[4096,1024]{1,0}) tuple(%next, %layer)
}

%cond (c: (s32[], bf16[4096,1024])) -> pred[] {
  %c = (s32[], bf16[4096,1024]{1,0}) parameter(0)
  %bound = s32[]{:T(128)} constant(12)
  %counter = s32[]{:T(128)} get-tuple-element(%c), index=0
  ROOT %lt = pred[] compare(%counter, %bound), direction=LT
}

ENTRY %main (x: bf16[4096,1024]) -> (s32[], bf16[4096,1024]) {
  %x = bf16[4096,1024]{1,0} parameter(0)
  %zero = s32[] constant(0)
  %init = (s32[], bf16[4096,1024]{1,0}) tuple(%zero, %x)
  ROOT %while.8 = (s32[], bf16[4096,1024]{1,0}) while(%init), condition=%cond, body=%body
}
"""


def test_a_tpu_loop_without_a_known_trip_count_runs_its_body_as_often_as_its_condition_counts():
    """A scan over layers (``scan_layers=true``): the body's ops once per layer. Read once, a scanned
    GPT-2 small's v5e step modeled at 89 ms where its unscanned twin models at 215.6."""
    (layer,) = [k for k in read_hlo_kernels(SCAN_HLO) if k.name == "layer"]
    assert layer.launches == 12
    unknown = read_hlo_kernels(SCAN_HLO.replace("direction=LT", "direction=NE"))  # not a count: once
    assert [k.launches for k in unknown if k.name == "layer"] == [1]


@pytest.mark.parametrize("window,labels,lhs,rhs,out", [
    # XLA:TPU's batched matmul (batch 32 x heads 4, 32 x 16 by 16 x 32): the window spans the batch over an
    # input dilated by as much, one tap meeting a value per output (its forward and its backward form)
    ("size=32x4 stride=31x3 lhs_dilate=32x4", "0b1f_0o1i->01bf", (32, 32, 4, 16), (32, 32, 4, 16), (32, 4, 32, 32)),
    ("size=32x4 stride=32x4 pad=31_31x3_3 lhs_dilate=31x3 rhs_reversal=1x1", "0f1b_01oi->01fb",
     (32, 32, 4, 32), (32, 4, 16, 32), (32, 4, 32, 16)),
])
def test_a_batched_matmul_written_as_a_dilated_convolution_counts_its_products_once(window, labels, lhs, rhs, out):
    from train.inspections.matmul_flops import conv_flops

    assert conv_flops(out, rhs, f"window={{{window}}}, dim_labels={labels}", lhs) == 2 * 32 * 4 * 32 * 32 * 16
    # a 3 x 3 convolution over 8 x 8 padded by 1: the taps meeting a value, 22 of 24 along each axis
    # (XLA's HloCostAnalysis counts the same); without the input's shape, the whole window
    assert conv_flops((8, 8, 8, 32), (3, 3, 16, 32), "window={size=3x3 pad=1_1x1_1}, dim_labels=b01f_01io->b01f",
                      (8, 8, 8, 16)) == 2 * 8 * 32 * 16 * 22 * 22
    assert conv_flops((8, 8, 8, 32), (3, 3, 16, 32), "window={size=3x3 pad=1_1x1_1}, dim_labels=b01f_01io->b01f"
                      ) == 2 * 8 * 8 * 8 * 32 * 9 * 16


def test_a_dense_general_onto_heads_written_as_a_padded_convolution_counts_its_products_once():
    """XLA:TPU writes ``(b, t, 768) x (768, 12, 64) -> (b, t, 12, 64)`` (``nn.SelfAttention``'s projections) as a
    window of 12 taps over one input position padded by 11 on each side: one tap of each output meets it.
    Counting the whole window made each of GPT-2 small's q, k, v projections 12x its FLOPs, and the modeled
    bf16 v5e step of a GPT on Flax's attention (examples/user_models/linen_gpt.py) 328.7 ms; it is 221.6."""
    from train.inspections.matmul_flops import conv_flops

    rest = "window={size=1x12 pad=0_0x11_11 rhs_reversal=0x1}, dim_labels=0bf1_i1o0->0b1f"
    assert conv_flops((16, 1024, 12, 64), (768, 12, 64, 1), rest, (16, 1024, 768, 1)) == 2 * 16 * 1024 * 768 * 12 * 64
