"""The docs cannot rot. For README.md and every page of docs/:

- every relative link resolves: to a file, and to a heading for a ``#fragment``;
- every ``python`` block runs (a page's blocks in order, in one namespace), and an
  output block marked ``<!-- docs-check: output -->`` after it shows lines it printed;
  a block marked ``<!-- docs-check: excerpt of FILE -->`` is made of lines of FILE,
  which a test runs;
- every command of a ``bash`` block runs: experiments (``python -m train``) on tiny data
  for two steps, examples and benchmarks at small sizes, ``--help`` / ``--print-config`` /
  ``--explain`` as written; a command shown with its output (``$ command``) prints that
  output. The README's quick start is what CI runs (``.ci/run``, exactly as written); a
  command that needs several hosts is run by the named test that does the same on one
  machine; one that needs what CI has not (a GPU cluster) is listed below with the
  reason. A command in none of these fails the check: add it here.
"""

from __future__ import annotations

import ast
import contextlib
import importlib.util
import io
import pathlib
import re
import subprocess
import sys

import pytest
from docs_pages import ROOT, Command, anchors, blocks, commands, links, pages
from helpers import TINY_TEXT, subprocess_env, tiny_fashion_mnist

#: Commands run by a test that does the same on one machine: prefix -> that test.
RUN_BY_TESTS = {
    "XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m train configs/default.yaml mesh.fsdp=4 --explain":
        "tests/test_communication.py::test_multidevice_explain_lists_the_collectives_of_the_experiments_step",
    "python -m train configs/fmnist_resnet_mixed_bf16.yaml workdir=/shared/runs/fmnist distributed.":
        "tests/test_distributed.py::test_two_processes_train_checkpoint_resume_and_match_one_process",
    # JAX's CUDA plugin: CI's gpu-compile environment runs these (pytest -m gpu_compile)
    "python -m train configs/gpu/gpt2_small_mixed_bf16.yaml --compile-for h100 --mesh":
        "tests/test_compile_for.py::test_an_fsdp_step_on_8_h100s_gathers_params_in_bf16_and_its_gemms_stay_half",
    "python -m train configs/gpu/gpt2_small_mixed_bf16.yaml --compile-for h100 precision.policy=mixed_fp8":
        "tests/test_compile_for.py::test_mixed_fp8_with_min_size_0_gives_an_fp8_gemm_for_every_fp8_matmul",
    # the suite at its quick size, in process: each way of timing, ours against hand-written
    "python -m benchmarks --quick":
        "tests/test_benchmarks.py::test_the_suite_times_ours_against_hand_written_three_ways_and_saves_the_programs",
    # the same pick path, on the default experiment with its candidates (the docs command's run took 13 s more)
    "python -m train configs/default.yaml --pick-policy":
        "tests/test_policy_pick.py::test_the_default_experiment_is_picked_by_measurement_and_the_fragment_loads",
    # the CLI's --diagnose on a checkpointed run, and diagnose_experiment on configs/default.yaml itself
    "python -m train configs/default.yaml --diagnose":
        "tests/test_diagnose_training.py::test_diagnose_flag_reads_the_newest_checkpoint_and_leaves_checkpoints_untouched",
    "python -m train configs/gpu/gpt2_small_mixed_bf16.yaml --compile-for h100":
        "tests/test_compile_for.py::test_gpt2_small_half_steps_fuse_attention_in_every_layer_with_half_gemms_and_a_third_of_the_memory",
    "python -m train examples/user_models/hf_style.yaml model.name=hf_style.py:Llama --compile-for h100 --devices 8":
        "tests/test_tensor_compile.py::test_tensor_parallel_llama_on_8_h100s_gathers_in_bf16_and_sums_in_f32",
    # libtpu: CI's compile-only environment runs these (pytest -m tpu_compile), on the config made small
    "python -m train configs/gpu/gpt2_small_mixed_bf16.yaml --compile-for v5e":
        "tests/test_tpu_compile.py::test_the_gpt_compiles_for_one_v5e_chip_with_every_matmul_in_bfloat16",
    "python -m train configs/gpu/gpt2_small_mixed_bf16.yaml precision.policy=mixed_int8 --compile-for v5e":
        "tests/test_int8_compile.py::test_every_projection_mlp_and_head_matmul_is_an_int8_mxu_op_on_v5e_forward_and_backward",
    "python -m train configs/gpu/gpt2_small_mixed_bf16.yaml precision.policy=mixed_int8 --compile-for a100":
        "tests/test_int8_compile.py::test_the_a100_program_has_int8_gemms_with_int32_results_and_no_xla_loop",
    "python -m train configs/gpu/gpt2_small_mixed_bf16.yaml --compile-for v5p":
        "tests/test_tpu_compile.py::test_a_v5p_slice_of_eight_chips_gathers_fsdp_params_in_bfloat16",
}
#: Commands CI cannot run, and why.
NOT_HERE = {
    "srun ": "needs a SLURM cluster of GPU nodes",
    "sudo apt-get install -y dataset-fashion-mnist": "installs a Debian package as root; the tests train the shipped "
                                                     "configs on tiny IDX files and text instead",
}
#: Overrides that make an experiment tiny: two steps, no half-precision inference report, in a temporary workdir.
TINY_RUN = ["steps=2", "log_every=1", "eval_every=0", "checkpoint_every=0", "data.eval_batches=1",
            "inference_dtypes=[]", "progress=false", "compile_cache=null"]
#: Arguments that make each benchmark small ({tmp}: a temporary directory, {fmnist}: tiny Fashion-MNIST files).
SMALL_BENCHMARKS = {
    "benchmarks": ["--size", "quick", "--models", "mlp", "--policies", "fp32", "mixed_bf16", "--steps", "20",
                   "--rounds", "1", "--no-cache", "--out", "{tmp}"],
    "benchmarks.underflow": ["--steps", "2", "--batch", "64", "--probe-every", "1", "--data", "{fmnist}",
                             "--out", "{tmp}", "--docs", "{tmp}"],
    "benchmarks.wrapper_overhead": ["--steps", "2", "--batch", "8", "--width", "16", "--models", "mlp", "--no-cache",
                                    "--out", "{tmp}/overhead.md"],
    "benchmarks.loop": ["--steps", "3", "--rounds", "1", "--out", "{tmp}", "compile_cache=null"],
    "benchmarks.fp8_speed": ["--shapes", "tiny", "--steps", "2", "--rounds", "1", "--min-size", "0", "--out", "{tmp}"],
    "benchmarks.state_memory": ["--shapes", "tiny", "--policies", "mixed_bf16", "lean_bf16", "--time-shape", "tiny",
                                "--time-steps", "2", "--out", "{tmp}"],
    "benchmarks.diagnose_cost": ["--layers", "1", "--d-model", "32", "--heads", "2", "--vocab", "64", "--seq", "16",
                                 "--batch", "2", "--steps", "2", "--out", "{tmp}"],
}
#: Benchmarks too long for CI (hours of training): their documented arguments are parsed, their parts tested.
PARSED_ONLY = {"benchmarks.parity": "tests/test_benchmarks.py::test_parity_compares_against_fp32_with_the_goals",
               "benchmarks.fp8_parity": "tests/test_fp8.py::test_fp8_parity_reports_the_gap_to_bf16",
               "benchmarks.int8_parity": "tests/test_int8.py::test_int8_parity_tabulates_runs_against_bf16"}


# ----------------------------------------------------------------------------- links


@pytest.mark.parametrize("page", pages(), ids=lambda p: p.name)
def test_every_link_resolves(page):
    broken = []
    for target in links(page):
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        path, _, fragment = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if not resolved.exists():
            broken.append(f"{target}: no such file")
        elif fragment and fragment not in anchors(resolved):
            broken.append(f"{target}: no heading with anchor #{fragment} in {resolved.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


def test_the_readme_is_a_map_with_the_two_commands_first():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 250
    first = [b for b in blocks(ROOT / "README.md") if b.lang == "bash"][:2]
    assert [b.section for b in first] == ["Quick start", "Quick start"]
    assert "python -m train configs/default.yaml" in first[0].text and "python -m pytest" in first[1].text
    for page in sorted((ROOT / "docs").glob("*.md")):
        assert f"docs/{page.name}" in text, f"README.md does not link docs/{page.name}"


def test_ci_runs_the_readme_quick_start_exactly_as_written():
    script = (ROOT / ".ci" / "run").read_text()
    assert 'bash -c "$(python3 tests/docs_pages.py quickstart 1)"' in script
    assert 'bash -c "$(python3 tests/docs_pages.py quickstart 2)"' in script


def test_ci_runs_every_test_file_that_compiles_for_a_gpu_or_a_tpu():
    """The README's command skips tests marked gpu_compile / tpu_compile (no plugins): CI's
    compile-only step runs them, from the files it names, so a new file with one must be named."""
    script = (ROOT / ".ci" / "run").read_text()
    command = script[script.index('-m "(gpu_compile or tpu_compile) and not extended"'):
                     script.index("> .ci-gpu-compile-tests.log")]
    marker = re.compile(r"^[^#\n]*pytest\.mark\.(gpu|tpu)_compile\b", re.MULTILINE)
    marked = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "tests").glob("test_*.py")
                    if marker.search(p.read_text()) and p.name != "test_docs.py")  # this file: only its text
    assert len(marked) >= 8 and [f for f in marked if f not in command.split()] == []


# ----------------------------------------------------------------------------- python blocks


def _file_lines(path: str) -> set[str]:
    return {line.strip() for line in (ROOT / path).read_text().splitlines()}


def _shown(expected: str, printed: str) -> list[str]:
    """Lines of an output block that the output does not hold ("..." stands for lines left out;
    a line ending in "..." for the rest of that line)."""
    lines = [line.rstrip() for line in printed.splitlines()]
    missing = []
    for want in expected.strip("\n").splitlines():
        want = want.rstrip()
        if want == "...":
            continue
        if want.endswith("..."):
            if not any(line.startswith(want[:-3]) for line in lines):
                missing.append(want)
        elif want not in lines:
            missing.append(want)
    return missing


# An output that depends on whether JAX's CUDA plugin (a GPU install has it) and libtpu are installed.
_PLUGIN_OUTPUT = {(True, False): "output with the CUDA plugin", (False, False): "output without the CUDA plugin",
                  (True, True): "output with the CUDA plugin and libtpu"}


def _installed() -> tuple[bool, bool]:
    return (any(importlib.util.find_spec(f"jax_cuda{v}_plugin") for v in (12, 13)),
            importlib.util.find_spec("libtpu") is not None)


@pytest.mark.parametrize("page", [p for p in pages() if any(b.lang == "python" for b in blocks(p))],
                         ids=lambda p: p.name)
def test_python_blocks_run_and_print_what_they_show(page):
    namespace: dict = {"__name__": f"docs_{page.stem}"}
    printed = ""
    for block in blocks(page):
        where = f"{page.relative_to(ROOT)}:{block.line}"
        if block.marker.startswith("excerpt of "):
            source = block.marker.removeprefix("excerpt of ")
            foreign = [line for line in block.text.splitlines() if line.strip() and line.strip() not in
                       _file_lines(source)]
            assert not foreign, f"{where}: lines not in {source} (update the excerpt): {foreign}"
        elif block.marker in ("output", _PLUGIN_OUTPUT.get(_installed())):
            missing = _shown(block.text, printed)
            assert not missing, f"{where}: shown output not printed by the block before it: {missing}"
        elif block.lang == "python":
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                exec(compile(block.text, where, "exec"), namespace)  # noqa: S102 - the docs' own examples
            printed = out.getvalue()


# ----------------------------------------------------------------------------- commands


def _shown_commands() -> list[tuple[Command, str]]:
    """Every command of the pages, with the output shown under it (``$ command`` in a
    plain block), once each."""
    found, seen = [], set()
    for page in pages():
        for block in blocks(page):
            if block.lang == "bash" and block.section != "Quick start":
                items = [(c, "") for c in commands(block)]
            elif block.lang == "" and block.text.startswith("$ "):
                text = block.text.split("\n", 1)
                items = [(c, text[1] if len(text) > 1 else "") for c in
                         commands(block._replace(text=text[0].removeprefix("$ ") + "\n"))]
            else:
                continue
            for command, output in items:
                key = _effective(command) if not output else command.text
                if key not in seen:  # the same run twice (`benchmarks` and `benchmarks --quick` run quick): once
                    seen.add(key)
                    found.append((command, output))
    return found


def _effective(command: Command) -> str:
    """What running ``command`` here amounts to: a benchmark with its small arguments
    (later ones override the page's), else the command as written."""
    argv = command.argv
    if argv[1:2] == ["-m"] and argv[2:3] and argv[2] in SMALL_BENCHMARKS:
        shown = [a for a in argv[3:] if a not in ("--quick",)]
        return " ".join([*argv[:3], *(shown if argv[2] != "benchmarks" else []), *SMALL_BENCHMARKS[argv[2]]])
    return command.text


def _workspace(tmp_path: pathlib.Path) -> tuple[pathlib.Path, dict]:
    """A working directory holding the configs and examples, and tiny data."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    for name in ("configs", "examples"):
        (cwd / name).symlink_to(ROOT / name)
    data = tmp_path / "data"
    (data / "fmnist").mkdir(parents=True)
    tiny_fashion_mnist(data / "fmnist")
    (data / "plays.txt").write_text(TINY_TEXT)
    return cwd, {"tmp": str(tmp_path / "out"), "fmnist": str(data / "fmnist"), "text": str(data / "plays.txt")}


def _train_argv(argv: list[str], cwd: pathlib.Path, paths: dict) -> list[str]:
    """A ``python -m train`` command made tiny, on tiny data where it reads files CI lacks.

    ``--explain`` traces the model on a batch of the data but trains nothing: it keeps its
    sizes and only gets the tiny data (CI has neither Fashion-MNIST nor the plays)."""
    if {"--help", "--print-config"} & set(argv):
        return argv
    from train.config import load_config

    config = load_config(cwd / argv[3], [a for a in argv[4:] if "=" in a])
    extra = [] if "--explain" in argv else [*TINY_RUN, f"workdir={paths['tmp']}/run"]
    if config.data.name in ("fashion_mnist", "shakespeare"):
        tiny = paths["fmnist"] if config.data.name == "fashion_mnist" else paths["text"]
        if config.data.path is None:
            extra.append(f"data.path={tiny}")
        elif not (cwd / config.data.path).exists():  # a file the page asks the reader to bring
            (cwd / config.data.path).symlink_to(tiny)
    return [*argv, *extra]


def _runnable(command: Command, cwd: pathlib.Path, paths: dict) -> list[str] | str:
    """The argv to run for ``command``, or why it is not run here."""
    for prefix, test in RUN_BY_TESTS.items():
        if command.text.startswith(prefix):
            return f"run by {test}"
    for prefix, reason in NOT_HERE.items():
        if command.text.startswith(prefix):
            return reason
    argv = command.argv
    if argv[:1] != ["python"]:
        raise AssertionError(f"{command.where}: `{command.text}` is not checked: run it in tests/test_docs.py, "
                             f"or list it in RUN_BY_TESTS / NOT_HERE with the reason")
    if argv[1:3] == ["-m", "train"]:
        return _train_argv(argv, cwd, paths)
    if argv[1] == "-m" and argv[2] in SMALL_BENCHMARKS:
        return [*argv, *(a.format(**paths) for a in SMALL_BENCHMARKS[argv[2]])]
    if argv[1] == "-m" and argv[2] in PARSED_ONLY:
        return f"parsed only; its parts run by {PARSED_ONLY[argv[2]]}"
    if argv[1].startswith("examples/"):
        return argv
    raise AssertionError(f"{command.where}: `{command.text}` is not checked: add it to tests/test_docs.py")


@pytest.mark.parametrize("command, output", _shown_commands(), ids=lambda c: c.text if isinstance(c, Command) else "")
def test_shown_commands_run(command, output, tmp_path):
    cwd, paths = _workspace(tmp_path)
    argv = command.argv if output else _runnable(command, cwd, paths)  # shown with its output: as written
    if isinstance(argv, str):
        _check_not_run(command, argv)
        return
    env = subprocess_env(**command.env, JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, *argv[1:]], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=600)
    if output:  # a command shown with its output: exactly what it prints, failure or not
        missing = _shown(output, proc.stdout + proc.stderr)
        assert not missing, f"{command.where}: `{command.text}` did not print {missing}:\n{proc.stderr[-3000:]}"
        return
    assert proc.returncode == 0, f"{command.where}: `{' '.join(argv)}` exited {proc.returncode}:\n" \
                                 f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    assert "Traceback" not in proc.stderr


def _check_not_run(command: Command, why: str) -> None:
    """What stands in for a command not run: the named test exists, the arguments parse."""
    if why.startswith(("run by ", "parsed only")):
        test = why.split(" by ")[-1]
        path, _, name = test.partition("::")
        defined = {node.name for node in ast.walk(ast.parse((ROOT / path).read_text()))
                   if isinstance(node, ast.FunctionDef)}
        assert name in defined, f"{command.where}: {why}, but {test} does not exist"
    if why.startswith("parsed only"):
        from benchmarks import parity

        parity.parser().parse_args(command.argv[3:])
