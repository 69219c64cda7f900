"""Shared test settings: CPU, deterministic, fast.

Tests marked ``gpu`` need JAX's default backend to be a GPU (run them with
``JAX_PLATFORMS=cuda``); anywhere else they are skipped, with the reason.
"""

import os
import shutil
import subprocess
import sys
import tempfile
from importlib.metadata import version

import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu")


def _xla_takes(flag: str) -> bool:
    """Whether this jaxlib's XLA knows ``flag`` (an unknown flag in XLA_FLAGS aborts the process):
    so for the jaxlib versions the suite is measured with, else asked once, in a subprocess."""
    if version("jaxlib").startswith("0.10."):
        return True
    probe = subprocess.run([sys.executable, "-c", "import jax; jax.devices('cpu')"], capture_output=True,
                           env={**os.environ, "XLA_FLAGS": flag}, timeout=300)
    return probe.returncode == 0


# The tests check what programs compute, not how fast XLA's generated code runs: without LLVM's
# backend optimizations the suite compiles its thousands of small programs about 30% faster, and
# XLA:CPU's older elemental emitters compile them about 30% faster again than its MLIR fusion
# emitters (the doctor's tests: 262 s of CPU -> 184 s). CPU runs only: a GPU run keeps its flags.
# (Set before JAX starts; subprocesses inherit it through subprocess_env.)
FAST_COMPILE = ["--xla_backend_optimization_level=0"]
if os.environ["JAX_PLATFORMS"] == "cpu":
    FAST_COMPILE.append("--xla_cpu_use_fusion_emitters=false")
for _flag in FAST_COMPILE:
    if _flag.split("=")[0] not in os.environ.get("XLA_FLAGS", "") and _xla_takes(_flag):
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_flag}".strip()
# Runs (and the CLI subprocesses tests start) share one compilation cache for the session,
# never the user's ~/.cache.
_OWN_CACHE = None
if "MP_COMPILE_CACHE_DIR" not in os.environ:
    _OWN_CACHE = os.environ["MP_COMPILE_CACHE_DIR"] = tempfile.mkdtemp(prefix="mp-test-compile-cache-")


def pytest_unconfigure(config):
    if _OWN_CACHE is not None:
        shutil.rmtree(_OWN_CACHE, ignore_errors=True)

from hypothesis import settings  # noqa: E402

settings.register_profile("ci", max_examples=200, deadline=None, derandomize=True)
settings.load_profile("ci")


#: Tests that take minutes: started first, so that they run beside the rest, not after it.
LONGEST_FIRST = ("test_the_8_device_tests_pass_on_forced_host_devices",
                 "test_a_float16_overflow_planted_in_a_t5_feed_forward")

#: The slowest tests (node ids, or their start: every case of a parametrized test), marked ``slow``:
#: the README's test command leaves them out (pyproject's addopts: -m 'not slow') so that it runs in
#: under 15 minutes on 2 cores; CI runs them in a step of its own (``python -m pytest -m slow``).
#: Seconds on 2 idle cores (2026-11-29, the README's command with --durations): about 520 of 2,070;
#: the benchmark scripts and the cases below (2026-11-30) about 145 more.
SLOW = (
    "tests/test_distributed.py::test_the_8_device_tests_pass_on_forced_host_devices",  # 109
    "tests/test_distributed.py::test_two_processes_train_checkpoint_resume_and_match_one_process",  # 26
    "tests/test_diagnose_models.py::test_a_float16_overflow_planted_in_a_t5_feed_forward",  # 43
    "tests/test_diagnose_models.py::test_healthy_models_written_elsewhere_diagnose_clean[T5-style",  # 29 (one here)
    "tests/test_diagnose_training.py::test_every_shipped_config_diagnoses_clean_under_its_policy",  # 95
    "tests/test_train_step.py::test_cross_entropy_is_optaxs_loss_and_argmaxs_correctness_in_one_pass",  # 25
    "tests/test_stored.py::test_a_pinned_float32_nnx_model_gets_bfloat16_params_and_state_under_lean_bf16",  # 21
    "tests/test_faults.py::test_a_run_sigkilled_at_random_moments_still_ends_identical",  # 21
    "tests/test_fp8.py::test_delayed_state_is_checkpointed_and_a_resumed_run_matches_bit_for_bit",  # 20
    "tests/test_export.py::test_a_hugging_face_gpt2_fine_tuned_with_lora_exports_to_a_directory",  # 20
    "tests/test_train_loop.py::test_a_huge_model_says_so_before_tracing_and_ctrl_c_stops_it_at_once",  # 17
    "tests/test_blockwise_loss.py::test_any_block_size_gives_the_whole_computation_in_float32",  # 15
    "tests/test_user_experiments.py::test_a_user_linen_lm_without_train_is_interrupted_and_resumes",  # 24
    "tests/test_serving.py::test_the_doctor_names_what_overflows_only_when_decoding_in_float16",  # 13
    # Benchmark scripts (2026-11-30: the README's command took 14:41 on 2 idle cores): each is a
    # script a lease or a results table runs, checked here end to end at its smallest size.
    "tests/test_benchmarks.py::test_norms_and_loss_times_each_switch_and_runs_the_largest_batch_each_allows",  # 29
    "tests/test_benchmarks.py::test_model_calibration_fits_our_profile_and_checks_the_rest_on_the_programs_given",  # 13
    "tests/test_benchmarks.py::test_decode_speed_times_tokens_and_takes_what_one_layer_adds_from_two_depths",  # 12
    "tests/test_benchmarks.py::test_the_suite_times_ours_against_hand_written_three_ways_and_saves_the_programs",  # 10
    "tests/test_docs.py::test_shown_commands_run[python -m benchmarks.state_memory-]",  # 12
    "tests/test_docs.py::test_shown_commands_run[python -m benchmarks.diagnose_cost-]",  # 10
    "tests/test_docs.py::test_shown_commands_run[python -m benchmarks.underflow-]",  # 10
    "tests/test_docs.py::test_shown_commands_run[python -m benchmarks.fp8_speed --shapes gpt2_small,llama_1b-]",  # 9
)

#: Cases whose subject another case checks as well (a sibling parameter, the same code path, the
#: same run without a flag), marked ``slow`` and ``extended``: CI leaves them out too (2026-12-01:
#: its 30 minutes on 2 cores were spent; these were about 250 s of its CPU). ``-m extended`` runs them.
EXTENDED = (
    "tests/test_docs.py::test_shown_commands_run[XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m train "
    "examples/user_models/hf_style.yaml mesh.tensor=4 mesh.fsdp=2 --explain-]",  # 9: the same run without --explain
    "tests/test_diagnose_models.py::test_healthy_models_written_elsewhere_diagnose_clean[ViT-style",  # 8
    "tests/test_diagnose_models.py::test_healthy_models_written_elsewhere_diagnose_clean[NNX LM",  # 7
    "tests/test_serving_nf4.py::test_a_qlora_run_of_a_hugging_face_gpt2_decodes_its_conv1d_codes_through_its_own_cache",  # 15
    # 2026-11-30, third stop (a fresh clone's first run of the README's command took 14:53, a second 13:28):
    # parameters and cases whose code path a sibling in the default suite takes too.
    "tests/test_stored.py::test_a_lean_run_from_a_config_says_its_bytes_and_resumes_bit_for_bit[params=",  # 20: lean_int8
    "tests/test_faults.py::test_a_corrupted_latest_checkpoint_is_reported_set_aside_and_the_previous_one_used[_delete_metadata]",
    "tests/test_faults.py::test_a_corrupted_latest_checkpoint_is_reported_set_aside_and_the_previous_one_used[_garble_meta]",
    "tests/test_faults.py::test_a_corrupted_latest_checkpoint_is_reported_set_aside_and_the_previous_one_used[_flip_bytes_and",
    # 15 for those three: _truncate, _flip_bytes and _delete_manifest stay
    "tests/test_faults.py::test_a_checkpoint_without_its_manifest_falls_back_quietly_through_the_cli",  # 11: _delete_manifest
    "tests/test_faults.py::test_a_sigkilled_run_resumes_from_its_last_complete_checkpoint_to_the_same_params[fault1",  # 8
    "tests/test_finetune.py::test_a_lora_run_resumes_exactly[bf16]",  # 9: [nf4]
    "tests/test_finetune.py::test_qlora_a_base_in_codes_trains_its_adapters_and_reads_the_weights_it_stores[int8",  # 7: nf4
    "tests/test_docs.py::test_shown_commands_run[python -m train configs/shakespeare_gpt_mixed_bf16.yaml "
    "precision.policy=mixed_f16 data.path=my.txt-]",  # 14: test_train_data reads a data.path
    "tests/test_docs.py::test_shown_commands_run[XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m train "
    "configs/default.yaml mesh.fsdp=2-]",  # 7: the hf_style run on mesh.tensor=4 mesh.fsdp=2
    "tests/test_diagnose_models.py::test_healthy_models_written_elsewhere_diagnose_clean[Llama-style",  # 10
    "tests/test_tpu_attention.py::test_lowered_for_a_tpu_attention_runs_the_pallas_kernel_with_the_unfused_numbers"
    "[HF-style Llama, grouped kv heads-one chip",  # 5: its slice case stays
    "tests/test_export.py::test_adapters_on_transposed_square_dense_general_batched_and_einsum_kernels_merge[nnx]",  # 9
    "tests/test_train_loop.py::test_a_larger_steps_continues_a_finished_run",  # 11: the interrupted run's resume
    "tests/test_pretrained.py::test_lora_on_a_hugging_face_gpt2_trains_its_adapters_on_the_frozen_pretrained_base",
    # 10: test_serving samples an exported LoRA fine-tune of a Hugging Face GPT-2; test_finetune trains LoRA
    # 2026-12-01: the same command with --explain is in the suite, and
    # test_int8.py::test_a_small_lm_trains_under_int8_to_the_loss_of_bf16_and_keeps_the_state_as_it_was
    "tests/test_docs.py::test_shown_commands_run[python -m train configs/shakespeare_gpt_mixed_bf16.yaml "
    "precision.policy=mixed_int8-]",  # 20
    "tests/test_diagnose_models.py::test_healthy_models_written_elsewhere_diagnose_clean[T5-style encoder-decoder-"
    "mixed_bf16]",  # 16: mixed_f16's, where T5 overflows
    "tests/test_user_experiments.py::test_a_user_linen_lm_without_train_is_interrupted_and_resumes_bit_exactly"
    "[mixed_f16]",  # 10: [mixed_bf16]
    # compile-only: each float32 config's half-precision sibling compiles with its policy kept
    "tests/test_compile_for.py::test_every_shipped_config_and_user_model_compiles_for_an_h100_with_its_policy_kept"
    "[shakespeare_gpt_fp32]",  # 10
    "tests/test_compile_for.py::test_every_shipped_config_and_user_model_compiles_for_an_h100_with_its_policy_kept"
    "[fmnist_resnet_fp32]",  # 6
)


@pytest.hookimpl(tryfirst=True)  # before -m selects by markers
def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.nodeid.startswith(SLOW + EXTENDED):
            item.add_marker(pytest.mark.slow)
        if item.nodeid.startswith(EXTENDED):
            item.add_marker(pytest.mark.extended)
    items.sort(key=lambda item: not item.name.startswith(LONGEST_FIRST))  # stable: the rest keep their order
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu_items:
        return
    import jax  # only now: a session without gpu tests does not start a backend here

    backend = jax.default_backend()
    if backend == "gpu":
        return
    skip = pytest.mark.skip(reason=f"needs a GPU: JAX's default backend is {backend!r} "
                                   f"(run with JAX_PLATFORMS=cuda on a machine with one)")
    for item in gpu_items:
        item.add_marker(skip)


@pytest.fixture
def doctor_off(monkeypatch):
    """For tests of the loop's stop rule, not of the doctor: the diagnosis a non-finite stop
    (or a loss scale at its minimum) makes, a large probed program, is stood in for by a line
    (tests/test_diagnose_training.py checks the real one)."""
    from train.training.diagnose import RunDoctor

    monkeypatch.setattr(RunDoctor, "diagnose", lambda self, state, step, reason: "(doctor off in this test)")


@pytest.fixture
def ctrl_c_raises():
    """Ctrl-C (SIGINT) raising ``KeyboardInterrupt``, as Python sets it up in a terminal, for a
    test that presses it: the test runner may have been started with SIGINT ignored (a
    background job, ``nohup`` under some shells), which Python then keeps. Restored after."""
    import signal

    previous = signal.getsignal(signal.SIGINT)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


@pytest.fixture
def kernels_on_cpu(monkeypatch):
    """The int8 products' TPU branch taken on this CPU, their Pallas kernels interpreted."""
    import functools

    from precision.autocast.scaled import int8_pallas, int8_tpu

    monkeypatch.setattr(int8_tpu, "choose", lambda kernel, fallback, *args: kernel(*args))
    monkeypatch.setattr(int8_tpu, "rows_matmul", functools.partial(int8_pallas.rows_matmul, interpret=True))
    monkeypatch.setattr(int8_tpu, "tiles_matmul", functools.partial(int8_pallas.tiles_matmul, interpret=True))
