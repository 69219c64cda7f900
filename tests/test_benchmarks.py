"""The benchmark suite's own measurements: HLO FLOP counting, saved-residual
bytes, timing ratios, reports and the parity comparison. The suite itself is
run by hand (`python -m benchmarks --quick`), not in tests: only its command line is."""

import pathlib
import time

import chex
import jax
import jax.numpy as jnp
import pytest

from benchmarks import hlo, measure, parity, report, suite
from benchmarks.__main__ import main as benchmarks_main


def test_matmul_flops_counts_dots_and_convolutions_by_input_dtype():
    def f(x, w, k):
        y = jnp.dot(x.astype(jnp.bfloat16), w.astype(jnp.bfloat16))          # 2*8*16*4 = 1024, bf16
        z = jax.lax.conv_general_dilated(k, jnp.ones((3, 3, 2, 5)), (1, 1), "SAME",
                                         dimension_numbers=("NHWC", "HWIO", "NHWC"))  # 2*(1*6*6*5)*(3*3*2) f32
        return y.sum() + z.sum()

    lowered = jax.jit(f).lower(jnp.ones((8, 16)), jnp.ones((16, 4)), jnp.ones((1, 6, 6, 2)))
    flops = hlo.matmul_flops(lowered.as_text(dialect="hlo"))
    assert flops.by_dtype["bf16"] == 1024
    assert flops.by_dtype["f32"] == 2 * (6 * 6 * 5) * (3 * 3 * 2)
    assert flops.half_share == pytest.approx(1024 / (1024 + 2 * 180 * 18))


def test_matmul_flops_reads_gpu_library_calls():
    text = """
ENTRY %main (p0: f16[64,128], p1: f16[128,32], x: bf16[2,8,8,4], k: bf16[3,3,4,6]) -> f16[64,32] {
  %p0 = f16[64,128]{1,0} parameter(0)
  %p1 = f16[128,32]{1,0} parameter(1)
  %gemm = (f16[64,32]{1,0}, s8[4194304]{0}) custom-call(f16[64,128]{1,0} %p0, f16[128,32]{1,0} %p1), custom_call_target="__cublas$gemm", backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"],"lhs_batch_dimensions":[],"rhs_batch_dimensions":[]}}}
  %conv = (bf16[2,8,8,6]{3,2,1,0}, u8[0]{0}) custom-call(%x, %k), window={size=3x3 pad=1_1x1_1}, dim_labels=b01f_01io->b01f, custom_call_target="__cudnn$convForward"
  ROOT %t = f16[64,32]{1,0} get-tuple-element(%gemm), index=0
}
"""
    flops = hlo.matmul_flops(text)
    assert flops.by_dtype["f16"] == 2 * 64 * 32 * 128
    assert flops.by_dtype["bf16"] == 2 * (2 * 8 * 8 * 6) * (3 * 3 * 4)
    assert flops.half_share == 1.0


def test_saved_residual_bytes_follow_the_compute_dtype():
    def loss(w, x):
        h = jnp.tanh(x @ w)  # tanh saves h and 1 - h**2: 2 x 16x32 values
        return (h @ w).astype(jnp.float32).sum()

    for dtype, itemsize in ((jnp.float32, 4), (jnp.bfloat16, 2)):
        w, x = jnp.ones((32, 32), dtype), jnp.ones((16, 32), dtype)
        got = measure.activation_bytes(measure.saved_residuals(loss, w, x))
        assert got["by_dtype"] == {jnp.dtype(dtype).name.replace("float", "f"): 2 * 16 * 32 * itemsize}
        assert got["argument_bytes"] == (32 * 32 + 16 * 32) * itemsize  # w, x kept as they are: not activations
        assert got["param_copy_bytes"] == 0


def test_saved_residuals_are_read_as_data_and_safe_from_several_threads():
    """The suite traces residuals in its compile threads: every thread must get the whole
    list (redirecting stdout to capture print_saved_residuals is process-wide)."""
    import concurrent.futures

    def loss(w, x):
        h = jax.nn.relu(x @ w)
        return jnp.sum(jnp.tanh(h @ w.astype(jnp.bfloat16).astype(jnp.float32)))

    w, x = jnp.ones((16, 16)), jnp.ones((8, 16))
    expected = measure.saved_residuals(loss, w, x)
    assert measure.activation_bytes(expected)["bytes"] > 0
    assert measure._printed_residuals(loss, w, x) == expected  # the fallback for JAX without the data API
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda _: measure.saved_residuals(loss, w, x), range(32)))
        printed = list(pool.map(lambda _: measure._printed_residuals(loss, w, x), range(8)))
    assert all(g == expected for g in got + printed)


def test_alternating_ratio_measures_the_slower_call():
    # Sleeps, not kernels: what is tested is the measurement, on any backend (a
    # GPU runs a small matmul about as fast as an add: both are launch-bound).
    def sleeper(seconds):
        def call(carry):
            time.sleep(seconds)
            return carry + 1
        return call

    r = measure.alternating_ratio(sleeper(0.002), jnp.zeros(()), sleeper(0.008), jnp.zeros(()), rounds=4,
                                  steps_per_round=2)
    assert 2.0 < r["ratio"] < 10.0 and len(r["ratios"]) == 4
    assert r["b_seconds"] >= 0.008 and r["a_seconds"] >= 0.002


def test_peak_flops_is_known_for_datacenter_gpus_only():
    class Device:
        def __init__(self, platform, device_kind):
            self.platform, self.device_kind = platform, device_kind

    assert measure.peak_flops(Device("gpu", "NVIDIA H100 80GB HBM3"), "half") == 989e12
    assert measure.peak_flops(Device("cpu", "cpu"), "half") is None
    assert measure.peak_flops(Device("gpu", "Some Future GPU"), "half") is None
    if jax.default_backend() == "cpu":  # whatever backends this run has (JAX_PLATFORMS=cuda has no CPU)
        assert measure.peak_flops(jax.devices()[0], "half") is None


def test_benchmarks_cli_refuses_fewer_than_20_timed_steps(capsys):
    with pytest.raises(SystemExit):
        benchmarks_main(["--quick", "--steps", "5"])
    assert "at least 20" in capsys.readouterr().err


def test_a_quick_run_never_overwrites_the_committed_tables(monkeypatch, tmp_path):
    """``--quick`` writes to a scratch directory unless ``--out`` says otherwise;
    a full-size run writes the committed tables."""
    written = []
    monkeypatch.setattr(suite, "run", lambda settings, log: {})
    monkeypatch.setattr(report, "save", lambda results, directory: written.append(directory) or (directory, directory))
    monkeypatch.setattr(report, "table", lambda results: "")
    monkeypatch.setattr(report, "headline", lambda results: {})
    benchmarks_main(["--quick", "--no-cache", "--models", "mlp"])
    benchmarks_main(["--quick", "--no-cache", "--models", "mlp", "--out", str(tmp_path)])
    benchmarks_main(["--size", "full", "--no-cache", "--models", "mlp"])
    assert written == [report.SCRATCH, tmp_path, report.RESULTS]
    assert report.RESULTS.resolve() not in report.SCRATCH.resolve().parents
    assert report.SCRATCH.resolve() != report.RESULTS.resolve()


def test_a_quick_run_leaves_the_large_vocabulary_models_to_the_full_sizes(monkeypatch):
    """``--quick`` measures every model but GPT-2's 50,304-token vocabulary ones (most of a
    quick run's time on 2 cores), unless asked for them; full sizes measure all."""
    from benchmarks.workloads import LARGE_VOCABULARY, MODELS

    measured = []
    monkeypatch.setattr(suite, "run", lambda settings, log: measured.append(settings.models) or {})
    monkeypatch.setattr(report, "save", lambda results, directory: (directory, directory))
    monkeypatch.setattr(report, "table", lambda results: "")
    monkeypatch.setattr(report, "headline", lambda results: {})
    for argv in (["--quick"], ["--quick", "--models", "gpt2_small"], ["--size", "full"]):
        benchmarks_main([*argv, "--no-cache"])
    quick, asked, full = measured
    assert set(quick) == set(MODELS) - set(LARGE_VOCABULARY) and "gpt" in quick
    assert asked == ("gpt2_small",) and full == MODELS


def _run(steps, accuracies, losses, scales=(1.0,)):
    records = [{"kind": "train", "step": s, "loss": 1.0 / s, "loss_scale": scales[min(i, len(scales) - 1)]}
               for i, s in enumerate(steps)]
    records += [{"kind": "eval", "step": steps[-1], "loss": losses, "accuracy": accuracies}]
    summary = {"eval": {"loss": losses, "accuracy": accuracies}, "steps": steps[-1], "train_seconds": 60.0,
               "steps_per_sec": 1.0, "policy": "p", "inference": {"float32": {"accuracy": accuracies, "loss": losses}},
               "loss_scale": {"initial": scales[0], "final": scales[-1], "decreases": 0, "skipped_steps": 0}}
    return {"summary": summary, "records": records}


def test_parity_compares_against_fp32_with_the_goals():
    runs = {"exp": {"fp32": _run([50, 100], 0.900, 0.300),
                    "mixed_bf16": _run([50, 100], 0.896, 0.305),      # -0.4 pp, +1.7%: within
                    "mixed_f16": _run([50, 100], 0.890, 0.300, (2.0 ** 15, 2.0 ** 14))}}  # -1.0 pp: not
    table = parity.compare(runs)["exp"]
    assert table["mixed_bf16"]["within_goals"] and not table["mixed_f16"]["within_goals"]
    assert table["mixed_f16"]["accuracy_delta_pp"] == pytest.approx(-1.0)
    assert table["mixed_f16"]["loss_scale_history"] == [(50, 2.0 ** 15), (100, 2.0 ** 14)]


def test_report_names_result_files_by_device():
    assert report.device_slug({"platform": "cpu", "device": "cpu (x86_64)"}) == "cpu"
    assert report.device_slug({"platform": "gpu", "device": "NVIDIA H100 80GB HBM3"}) == "nvidia-h100-80gb-hbm3"


def test_underflow_fraction_counts_gradients_float16_flushes_to_zero():
    from benchmarks.underflow import Autoencoder, underflow_fraction
    import precision

    model = Autoencoder(widths=(16, 4, 16))
    m32, m16 = precision.with_policy(model, "fp32"), precision.with_policy(model, "pure_f16")
    images = jax.random.uniform(jax.random.key(0), (16384, 28, 28))
    params = m32.init(jax.random.key(1), images[:1])["params"]
    large = underflow_fraction(m32, m16, params, images)          # mean over 16384 x 784 pixels
    small = underflow_fraction(m32, m16, params, images[:16])     # mean over 16 x 784
    assert large["zero_in_f16"] > 0.95 and small["zero_in_f16"] < 0.2
    assert 0 <= large["below_f16_min"] < large["zero_in_f16"]  # activation gradients underflow first


def test_pinned_workload_compiles_to_its_unpinned_twin():
    """A model whose layers pin dtype=float32 trains in half precision with the
    same compiled cost as its unpinned twin (XLA FLOPs and bytes accessed)."""
    from benchmarks import suite
    from benchmarks.workloads import policy_case, workload

    costs = {}
    for name in ("mlp", "mlp_pinned"):
        w = workload(name, "quick")
        prepared = suite.prepare_case(w, policy_case("mixed_bf16"), suite.initial_variables(w))
        share = hlo.matmul_flops(prepared.lowered.as_text(dialect="hlo")).half_share
        costs[name] = (share, measure.compiled_flops(prepared.step), measure.compiled_bytes_accessed(prepared.step))
    assert workload("mlp_pinned", "quick").model.dtype == jnp.float32
    assert costs["mlp"][0] == costs["mlp_pinned"][0] == 1.0
    for a, b in zip(costs["mlp"][1:], costs["mlp_pinned"][1:]):
        assert abs(b / a - 1) < 0.02


def test_train_step_reads_and_writes_no_more_than_a_hand_written_step():
    """XLA's bytes accessed of our train step (mixed_bf16, AdamW, select skip) against the
    hand-written JAX + optax step of the same dtypes, on the suite's quick models. The one
    pass the wrapper adds is its finiteness check, reading each gradient once (bf16): 2.5%
    of the MLP's step, whose bytes are mostly the optimizer's (3M params, batch 128). The
    loss's correctness (accuracy), read in the log-sum-exp's own pass over the logits, adds
    0.6% on XLA:CPU, which does not fuse it there; on a GPU it saves a pass (the H100
    programs, tests/test_step_cost.py)."""
    from benchmarks.wrapper_overhead import bytes_accessed

    limits = {"mlp": 1.035, "resnet": 1.02, "gpt": 1.02}
    ratios = {name: bytes_accessed(name, "quick", ("select",))["select_ratio"] for name in limits}
    assert all(ratios[name] <= limit for name, limit in limits.items()), ratios


def test_the_loop_benchmark_measures_the_loop_against_the_bare_step():
    from benchmarks.loop import DEFAULT_CONFIG, measure, table

    row = measure(DEFAULT_CONFIG, ["model.hidden=[16]", "data.batch_size=32", "precision.policy=mixed_bf16"],
                  steps=5, rounds=1)
    assert row["loop_steps_per_sec"] > 0 and row["bare_steps_per_sec"] > 0
    assert row["efficiency"] == row["loop_steps_per_sec"] / row["bare_steps_per_sec"]
    assert "mixed_bf16" in table([row])


def test_profile_step_sums_kernel_time_by_name_and_kind(tmp_path):
    """The profile's reader (``python -m benchmarks.profile_step``): on a CPU the host's XLA
    threads stand in for the device's streams; names sort into kinds as GPU kernels do."""
    from benchmarks import profile_step

    assert [profile_step.kind_of(k) for k in (
        "nvjet_sm90_tst_128x160_64x5_2x4_h_bz_NTT", "gemm_fusion_dot_52",
        "cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16", "input_add_reduce_fusion_8",
        "input_scatter_fusion", "void cudnn::fusion::compute_dot_do_o_specialized<true, 64>")] == [
        "gemm", "gemm", "attention", "reduction", "fusion", "attention"]
    f = jax.jit(lambda x: jnp.tanh(x @ x).sum())
    x = jnp.ones((256, 256))
    f(x).block_until_ready()
    with jax.profiler.trace(str(tmp_path)):
        for _ in range(3):
            f(x).block_until_ready()
    totals, source = profile_step.kernel_times(str(tmp_path))
    assert source == "host XLA threads" and totals and all(s >= 0 for s in totals.values()), (source, totals)
    with pytest.raises(FileNotFoundError, match="xplane"):
        profile_step.kernel_times(str(tmp_path / "empty"))


def test_gpt2_small_workload_and_its_model_flops_formula():
    """``gpt2_small`` at ``gpu`` size is GPT-2 small at its padded vocabulary with an untied
    head (163M params, configs/gpu/gpt2_small_mixed_bf16.yaml); its MFU numerator is
    6 N + 12 L d T per token with N the params that multiply (nanoGPT's estimate_mfu)."""
    from benchmarks.workloads import GPT2_VOCAB, model_flops_per_step, workload

    w = workload("gpt2_small", "gpu")
    m = w.model
    assert (m.vocab_size, m.num_layers, m.d_model, w.batch_size, w.tokens_per_example) == (GPT2_VOCAB, 12, 768, 16, 1024)
    params = jax.eval_shape(lambda: m.init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32)))["params"]
    total = sum(x.size for x in jax.tree_util.tree_leaves(params))
    assert 162e6 < total < 164e6
    embeddings = params["tokens"]["embedding"].size + params["positions"]["embedding"].size
    multiplying = sum(x.size for x in jax.tree_util.tree_leaves(params) if x.ndim == 2) - embeddings
    tokens = 16 * 1024
    assert model_flops_per_step(w) == (6 * multiplying + 12 * 12 * 768 * 1024) * tokens
    assert model_flops_per_step(workload("mlp", "quick")) is None


def test_modeled_step_is_none_off_a_modeled_gpu_and_an_error_is_reported_not_raised(monkeypatch):
    from types import SimpleNamespace

    import train.inspections.gpu_time as gpu_time

    text = jax.jit(lambda x: x @ x).lower(jnp.ones((256, 256))).compile().as_text()
    assert measure.modeled_step(text, jax.devices()[0]) is None  # a CPU
    h100 = SimpleNamespace(device_kind="NVIDIA H100 80GB HBM3", platform="gpu")
    modeled = measure.modeled_step(text, h100)
    assert modeled["target"] == "h100" and modeled["launches"] >= 1 and modeled["seconds"] > 0

    def unreadable(*_):
        raise ValueError("no datasheet")

    monkeypatch.setattr(gpu_time, "model_step", unreadable)
    assert measure.modeled_step(text, h100) == {"error": "ValueError: no datasheet"}


def test_ceilings_measure_a_product_and_a_copy_and_save_them(tmp_path, capsys):
    import json

    from benchmarks import ceilings

    result = ceilings.main(["--size", "128", "--copy-gib", "0.001", "--narrow", "int8", "fp8", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "ceilings.json").read_text())
    assert saved["matmul"]["n"] == 128 and saved["matmul"]["flops_per_second"] > 0
    for narrow in ("int8", "fp8"):
        assert saved["narrow_matmul"][narrow]["ops_per_second"] > 0
        assert saved["narrow_matmul"][narrow]["vs_bf16"] == pytest.approx(
            saved["narrow_matmul"][narrow]["ops_per_second"] / saved["matmul"]["flops_per_second"])
    assert saved["copy"]["bytes_per_second"] == result["copy"]["bytes_per_second"] > 0
    assert saved["matmul"]["datasheet_dense_bf16"] is None  # a CPU has no datasheet peak
    assert "TFLOP/s" in capsys.readouterr().out


def test_int8_tpu_step_extrapolates_a_depth_from_two_compiled_depths():
    from benchmarks.int8_tpu_step import extrapolated

    def row(layers, bf16, int8, bound):
        return {"layers": layers, "amdahl": bound, "mixed_bf16": {"modeled": {"seconds": bf16}},
                "mixed_int8": {"modeled": {"seconds": int8}}}

    # bf16: 0.5 fixed + 0.5 a layer; int8: 0.5 fixed + 0.3 a layer; the bound: 0.5 fixed + 0.25 a layer
    e = extrapolated({"L1": row(1, 1.0, 0.8, 0.75), "L2": row(2, 1.5, 1.1, 1.0 / 1.5)}, ("L1", "L2"), 24)
    assert e["mixed_bf16"]["per_layer"] == pytest.approx(0.5) and e["mixed_bf16"]["fixed"] == pytest.approx(0.5)
    assert e["mixed_int8"]["seconds"] == pytest.approx(0.5 + 24 * 0.3)
    assert e["ratio"] == pytest.approx(7.7 / 12.5) and e["per_layer_ratio"] == pytest.approx(0.6)
    assert e["amdahl"] == pytest.approx((0.5 + 24 * 0.25) / 12.5)


def test_int8_tpu_step_sets_the_ops_that_differ_most_side_by_side_either_way():
    from benchmarks.int8_tpu_step import differences

    bf16 = {"MLP in / conv fusion": 5.0, "qkv / copy copy": 4.0, "rest / fusion fusion": 1.0}
    int8 = {"MLP in / gemm int8_rows_matmul": 3.0, "qkv / copy copy": 4.5, "rest / fusion fusion": 1.0,
            "qkv / fusion copy_add_fusion": 6.0}
    top = differences(bf16, int8, top=3)
    assert top == [("qkv / fusion copy_add_fusion", 0.0, 6.0), ("MLP in / conv fusion", 5.0, 0.0),
                   ("MLP in / gemm int8_rows_matmul", 0.0, 3.0)]
    assert len(differences(bf16, int8)) == 5  # every entry of either, when fewer than top


def test_serving_lists_one_layers_decode_kernels_in_program_order_unnamed_gemms_included():
    from types import SimpleNamespace as NS

    from benchmarks.serving import layer_kernels

    def k(module, name, kind="fusion"):
        return NS(kernel=NS(kind=kind, name=name, module=module, bytes=2e6, launches=1), seconds=4e-6)

    program = [k("model/layers/0/mlp", "a"), k("model/layers/1/input_layernorm", "b", "reduction"),
               k("", "gemm.1", "gemm"), k("model/layers/1", "c"), k("model/layers/10/mlp", "d"), k("lm_head", "e")]
    listed = layer_kernels(NS(modeled=NS(kernels=program)))
    assert [x["name"] for x in listed] == ["b", "gemm.1", "c"]  # layers/10 is not layers/1
    assert [x["module"] for x in listed] == ["input_layernorm", "-", "(the layer)"]
    assert listed[0] == {"kind": "reduction", "name": "b", "module": "input_layernorm", "mb": 2.0, "us": 4.0}
    assert layer_kernels(NS(modeled=NS(kernels=program)), layer=3) == []


def test_tensor_parallel_extrapolates_each_quantity_linearly_in_depth():
    """A case compiled at 2 and 4 layers stands for its 32 with each quantity's per-layer slope."""
    from benchmarks.tensor_parallel import LINEAR, row_key, table_rows

    def row(layers, peak_gib):
        return {"case": "8b-tensor8", "layers": layers, "device_bytes": 80 * 2 ** 30, "peak_bytes": peak_gib * 2 ** 30,
                **{k: float(layers) for k in LINEAR if k != "peak_bytes"},
                "sent_by_kind": {"all-gather bf16": 10.0 * layers, "reduce-scatter f32": 1.0}}

    [guess] = table_rows({row_key("8b-tensor8", 4): row(4, 12), row_key("8b-tensor8", 2): row(2, 10)})
    assert guess["extrapolated_from"] == [2, 4] and guess["layers"] is None
    assert guess["peak_bytes"] == 40 * 2 ** 30 and guess["fits"]  # 10 GiB + 30 layers x 1 GiB
    assert guess["sent_bytes"] == guess["modeled_ms"] == 32.0
    assert guess["sent_by_kind"] == {"all-gather bf16": 320.0, "reduce-scatter f32": 1.0}
    [over] = table_rows({row_key("8b-tensor8", 2): row(2, 10), row_key("8b-tensor8", 4): row(4, 16)})
    assert not over["fits"]  # 10 GiB + 30 x 3 GiB


def test_the_narrow_chains_of_the_ceilings_never_decay_to_zeros():
    """Each product is narrowed back to int8 (or FP8) for the next: its entries stay spread like
    the first operand's, so the timed products never meet zeros (which run faster)."""
    from benchmarks.ceilings import narrow_product

    for dtype in ("int8", "fp8"):
        x, product = narrow_product(256, dtype)
        for _ in range(5):
            x = product(x)
        values = x.astype(jnp.float32)
        spread = float(jnp.std(values))
        assert (30 < spread < 127 if dtype == "int8" else 0.3 < spread < 3), (dtype, spread)
        assert float(jnp.mean(values == 0)) < 0.05, dtype


def test_the_suite_times_ours_against_hand_written_three_ways_and_saves_the_programs(tmp_path):
    """Alternating rounds, each back to back on its own, and each step waited for; with
    ``programs`` set, every compiled step's optimized HLO is written under the names
    ``benchmarks.model_calibration --programs`` reads."""
    settings = suite.Settings(size="quick", steps=2, warmup=1, rounds=2, steps_per_round=1, models=("mlp",),
                              policies=("fp32",), compile_threads=2, programs=str(tmp_path),
                              partial=str(tmp_path / "partial" / "so-far.json"))
    result = suite.run(settings, log=lambda line: None)
    (over,) = result["overhead"]
    for key in ("ratio", "back_to_back_ratio", "waited_ratio"):
        assert over[key] > 0
    assert over["back_to_back_ratio"] == pytest.approx(over["ours_back_to_back_seconds"]
                                                       / over["hand_written_back_to_back_seconds"])
    assert {p.name for p in tmp_path.glob("*.hlo")} == {
        "mlp-fp32-none-rules.hlo", "mlp-mixed_bf16-none-norules.hlo", "hand_written-mlp.hlo",
        "mlp-mixed_f16-none-rules.hlo", "mlp-mixed_f16-dynamic-rules.hlo"}
    assert "HloModule" in (tmp_path / "hand_written-mlp.hlo").read_text()
    import json  # what a run stopped at a time limit would have kept: here, all of it
    so_far = json.loads((tmp_path / "partial" / "so-far.json").read_text())
    assert [r["policy"] for r in so_far["rows"]] == ["fp32"] and len(so_far["loss_scale_overhead"]) == 1
    assert so_far["overhead"][0]["back_to_back_ratio"] == pytest.approx(over["back_to_back_ratio"])


def test_norms_and_loss_times_each_switch_and_runs_the_largest_batch_each_allows(tmp_path):
    from benchmarks import norms_and_loss

    result = norms_and_loss.main(["--size", "quick", "--model", "gpt", "--rounds", "1", "--steps", "1",
                                  "--limit-gib", "0.06", "--out", str(tmp_path)])
    variants = result["variants"]
    assert list(variants) == ["as shipped", "fuse_norms off", "blockwise_loss on", "blockwise_loss off"]
    for v in variants.values():
        assert v["step_seconds"] > 0 and v["plan_bytes_double"] > v["plan_bytes"] > 0
        assert v["largest_rows"] >= 1
        assert v["largest"]["ran"] and v["largest"]["rows"] == v["largest_rows"]
        assert v["largest"]["plan_bytes"] <= 0.06 * 2 ** 30
    text = (tmp_path / "norms-and-loss-cpu.md").read_text()
    assert "| fuse_norms off |" in text and "largest batch" in text


def test_model_calibration_fits_our_profile_and_checks_the_rest_on_the_programs_given(tmp_path):
    """Given the programs a lease ran, its profiles and its rows, the fit gives our step's
    GEMMs exactly their measured time, and every other step and the ratio ours / hand-written
    are checked against the model."""
    import json

    from benchmarks import model_calibration
    from benchmarks.profile_step import profile_kind
    from train.inspections.gpu_time import CALIBRATION, datasheet
    from train.inspections.hlo_kernels import read_hlo_kernels
    from train.inspections.targets import get_target

    programs = tmp_path / "programs"
    measured = suite.run(suite.Settings(size="quick", steps=2, warmup=1, rounds=1, steps_per_round=1, models=("mlp",),
                                        policies=("fp32", "mixed_bf16"), compile_threads=2, programs=str(programs)),
                         log=lambda line: None)
    measured["environment"] = {"jax": "0.0", "device": "a GPU", "date": "today"}
    (tmp_path / "measured.json").write_text(json.dumps(measured, default=float))
    sheet = datasheet(get_target("h200"))
    for name, program in (("ours", "mlp-mixed_bf16-none-rules"), ("hand", "hand_written-mlp")):
        kernels = read_hlo_kernels((programs / f"{program}.hlo").read_text())
        memory = json.loads(model_calibration.MEMORY.read_text())  # what the fit takes for memory-bound kernels
        at_half = CALIBRATION._replace(gemm_efficiency=0.01, min_kernel_seconds=memory["latency_seconds"],
                                       bandwidth_efficiency=memory["share"])  # GEMMs this small: compute-bound at 1%
        by_kind = {kind: model_calibration._busy([k for k in kernels if profile_kind(k) == kind], sheet, at_half)
                   for kind in model_calibration.PROFILE_KINDS}
        busy = sum(by_kind.values())
        (tmp_path / f"{name}.json").write_text(json.dumps({"by_kind": by_kind, "busy_seconds": busy,
                                                             "step_seconds_traced": 1.1 * busy,
                                                             "environment": {"date": "today"}}))
    result = model_calibration.main(["--programs", str(programs), "--model", "mlp", "--profile",
                                     str(tmp_path / "ours.json"), "--hand-profile", str(tmp_path / "hand.json"),
                                     "--measured", str(tmp_path / "measured.json"), "--out", str(tmp_path)])
    assert result["calibration"]["gemm_efficiency"] == pytest.approx(0.01, rel=1e-3)
    gemm = next(k for k in result["kinds"] if k["kind"] == "gemm")
    assert gemm["modeled"] == pytest.approx(gemm["measured"], rel=1e-3)
    notes = [s["note"] for s in result["steps"]]
    assert "ours on its own, back to back" in notes and "hand-written, alternating with ours" in notes
    assert {"modeled", "measured_alternating", "measured_back_to_back", "profiles_busy"} <= set(result["ratio"])
    assert "Ours / hand-written: modeled" in (tmp_path / "model-calibration.md").read_text()


def test_a_gpu_lease_carries_every_dependency_its_machine_lacks():
    """benchmarks/gpu_wheels.sh names, for each package this project and its tests need, either
    the lent machine's image (IMAGE_HAS) or a wheel to carry (WHEELS): a dependency added without
    its wheel would stop a lease at its first import (2026-11-29: pydantic)."""
    import re
    import tomllib

    root = pathlib.Path(__file__).resolve().parent.parent
    script = (root / "benchmarks" / "gpu_wheels.sh").read_text()
    listed = {name.lower().replace("_", "-") for key in ("IMAGE_HAS", "WHEELS")
              for name in re.findall(r"([A-Za-z][\w.-]*?)(?:==[\w.]+)?(?=[\s)])",
                                     re.search(key + r"=\(([^)]*)\)", script).group(1) + " ")}
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    needed = project["dependencies"] + project["optional-dependencies"]["test-core"]
    names = {re.match(r"[A-Za-z0-9_.-]+", spec).group(0).lower().replace("_", "-") for spec in needed}
    assert names - listed == set()
    assert "python3 -c \"import precision, train" in (root / "benchmarks" / "gpu_session.sh").read_text()


def test_decode_speed_times_tokens_and_takes_what_one_layer_adds_from_two_depths(tmp_path):
    from benchmarks import decode_speed

    result = decode_speed.main(["--shapes", "tiny,tiny_4", "--dtypes", "bf16", "--prompt", "8", "--tokens", "8",
                                "--out", str(tmp_path)])
    shallow, deep = result["rows"]
    assert deep["token_bytes"] > shallow["token_bytes"] and shallow["seconds_per_token"] > 0
    assert shallow["bandwidth"] == pytest.approx(shallow["token_bytes"] / shallow["seconds_per_token"])
    (layer,) = result["per_layer"]
    assert layer["layer_bytes"] == pytest.approx((deep["token_bytes"] - shallow["token_bytes"]) / 2)
    assert layer["deep_bytes"] == pytest.approx(shallow["token_bytes"] + 30 * layer["layer_bytes"])
    assert shallow["trace"]["wall_seconds"] > 0
    assert "What one layer adds" in (tmp_path / "decode-speed-cpu.md").read_text()


def test_the_loss_variants_agree_with_the_shipped_loss_on_ties_and_masked_logits(tmp_path):
    """Each candidate reduction of benchmarks.loss_variants gives the shipped loss and, but the
    loss alone, its correctness (the first largest logit), also where logits tie or are -inf."""
    from benchmarks import loss_variants
    from precision import losses

    logits = jax.random.normal(jax.random.key(1), (3, 5, 40), jnp.float32)
    logits = logits.at[0, :, 7:].set(-jnp.inf)  # a masked vocabulary
    logits = logits.at[1, 2].set(1.0).at[1, 3, :20].set(2.0)  # a row of equal logits; a tie for the largest
    labels = jnp.array([[3] * 5, [0, 0, 5, 0, 19], [1, 2, 3, 4, 39]], jnp.int32)
    loss, correct = losses.cross_entropy(logits, labels)
    assert bool(correct[1, 3]) and not bool(correct[1, 2])  # of tied maxima, the first (position 0) counts
    for name, ce in loss_variants.VARIANTS.items():
        got_loss, got_correct = jax.jit(ce)(logits, labels)
        chex.assert_trees_all_close(got_loss, loss, rtol=1e-5, atol=1e-6)
        if "alone" not in name:
            assert bool(jnp.all(got_correct == correct)), name
    result = loss_variants.main(["--shape", "2,8,64", "--calls", "2", "--out", str(tmp_path)])
    assert [r["variant"] for r in result["rows"]] == list(loss_variants.VARIANTS)
    assert all(r["loss_error"] < 1e-5 and r["with_gradient_seconds"] > 0 for r in result["rows"])


def test_the_rounding_cost_times_the_lean_update_with_each_generator_and_restores_the_shipped_one(tmp_path):
    from benchmarks import rounding_cost
    from precision import stored
    shipped = stored.hashed_bits
    result = rounding_cost.main(["--params", str(4096 * 4), "--calls", "2", "--out", str(tmp_path)])
    assert [r["bits"] for r in result["rows"]] == list(rounding_cost.GENERATORS)
    assert all(r["update_seconds"] > 0 and r["round_seconds"] > 0 for r in result["rows"])
    assert stored.hashed_bits is shipped
    assert "| hashed (shipped) |" in (tmp_path / "rounding-cost-cpu.md").read_text()
    with pytest.raises(SystemExit):
        rounding_cost.main(["--params", "1000", "--out", str(tmp_path)])
