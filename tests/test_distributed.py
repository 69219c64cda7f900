"""Data parallel and FSDP over a device mesh, and JAX's multi-process runtime.

The tests named ``test_multidevice_*`` need 8 devices. The ordinary (1-device)
test session runs them in a subprocess with 8 forced CPU host devices
(``XLA_FLAGS=--xla_force_host_platform_device_count=8``), see
``test_the_8_device_tests_pass_on_forced_host_devices``; the 2-process
test starts real ``jax.distributed`` processes with CPU (gloo) collectives.
"""

import os
import socket
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import precision
from helpers import saved_state, subprocess_env
from train import create_train_state, make_eval_step, make_multi_step, make_train_step
from train.training.checkpoint import Checkpointer
from train.config import ConfigError, from_dict
from train.data import load_synthetic, train_batch_stack
from train.parallel.distributed import Layout, MeshError, host_rows, initialize_distributed, make_mesh, to_host
from train.models import MLP

ROOT = Path(__file__).resolve().parent.parent
needs8 = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices: runs in the 8-device subprocess")


def _python_env(devices: int) -> dict:
    return subprocess_env(JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")


# ----------------------------------------------------------------------------- one device


def test_mesh_takes_all_devices_and_rejects_what_does_not_fit():
    mesh = make_mesh()
    assert mesh.shape == {"data": jax.device_count(), "fsdp": 1, "tensor": 1}
    n = jax.device_count()
    with pytest.raises(MeshError, match=r"mesh.data \* mesh.fsdp = 3 \* 1 = 3, but there are"):
        make_mesh(3 * n, 1) if n != 3 else make_mesh(2, 1)
    with pytest.raises(MeshError, match="mesh.fsdp=5 does not divide"):
        make_mesh(-1, 5 * n)
    with pytest.raises(MeshError, match="must be >= 1 or -1"):
        make_mesh(0, 1)


def test_fsdp_splits_large_arrays_along_their_last_divisible_dimension():
    class FakeMesh:  # param_spec reads only the fsdp size
        shape = {"data": 2, "fsdp": 4}

    layout = Layout(FakeMesh(), fsdp_min_size=64)
    P = jax.sharding.PartitionSpec
    assert layout.param_spec((64, 256)) == P(None, "fsdp")
    assert layout.param_spec((256, 64)) == P(None, "fsdp")  # output features, not the contracted input
    assert layout.param_spec((6, 20, 30)) == P(None, "fsdp")  # 30 % 4 != 0
    assert layout.param_spec((30, 30)) == P()  # nothing divisible: replicated
    assert layout.param_spec((8,)) == P()  # small: replicated
    assert layout.param_spec(()) == P()


def test_batch_sizes_must_split_over_the_data_shards():
    layout = Layout(make_mesh())
    layout.check_batch_size(jax.device_count() * 3)
    if jax.device_count() > 1:
        with pytest.raises(MeshError, match="data.batch_size=1 does not split"):
            layout.check_batch_size(1)


def test_a_single_process_reads_every_row():
    assert host_rows(12) == slice(0, 12)


def test_distributed_settings_are_validated():
    for raw, message in [
        ({"mesh": {"data": 0}}, "mesh.data must be >= 1, or -1"),
        ({"mesh": {"fsdp": 0}}, "mesh.fsdp must be >= 1"),
        ({"mesh": {"fsdp_min_size": -1}}, "mesh.fsdp_min_size must be >= 0"),
        ({"distributed": {"num_processes": 0}}, "distributed.num_processes must be >= 1"),
        ({"distributed": {"num_processes": 2, "process_id": 2}}, "process_id must be < distributed.num_processes=2"),
        ({"distributed": {"coordinator_address": "localhost"}}, "must be host:port"),
        ({"distributed": {"coordinator": "x:1"}}, "Did you mean 'distributed.coordinator_address'"),
    ]:
        with pytest.raises(ConfigError, match=message):
            from_dict(raw)


def test_partial_distributed_settings_name_what_is_missing(monkeypatch):
    for var in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
        monkeypatch.delenv(var, raising=False)
    assert initialize_distributed() is False  # single process: nothing to do
    with pytest.raises(MeshError, match="num_processes, process_id missing"):
        initialize_distributed("localhost:1234")
    monkeypatch.setenv("JAX_NUM_PROCESSES", "two")
    with pytest.raises(MeshError, match="JAX_NUM_PROCESSES must be an integer"):
        initialize_distributed("localhost:1234")
    monkeypatch.setenv("JAX_NUM_PROCESSES", "2")
    monkeypatch.setenv("JAX_PROCESS_ID", "0")
    jnp.zeros(1).block_until_ready()  # the backend is up: too late to join a multi-process run
    with pytest.raises(MeshError, match="must start before anything uses a device"):
        initialize_distributed("localhost:1234")


def test_a_mesh_that_does_not_fit_fails_before_compute(tmp_path):
    from train import run

    config = from_dict({"workdir": str(tmp_path / "run"), "mesh": {"data": jax.device_count() + 1},
                        "progress": False})
    with pytest.raises(ConfigError, match="mesh.data \\* mesh.fsdp"):
        run(config)
    assert not (tmp_path / "run").exists()


def test_diagnose_on_several_processes_refuses_with_one_line(monkeypatch, tmp_path):
    from train.inspections.checkup import diagnose_experiment
    from train.data import DataError

    monkeypatch.setattr(jax, "process_count", lambda: 2)
    with pytest.raises(DataError, match=r"^--diagnose runs in one process, and this is process 0 of 2: diagnose on one "
                                        r"host \(its devices can form the mesh\)$"):
        diagnose_experiment(from_dict({"workdir": str(tmp_path / "run"), "progress": False}))
    assert not (tmp_path / "run").exists()


def test_the_8_device_tests_pass_on_forced_host_devices():
    """Runs the ``test_multidevice_*`` tests of this file, test_communication.py and
    test_tensor_parallel.py in one process with 8 CPU devices."""
    if jax.device_count() >= 8:
        pytest.skip("already on 8 devices: the multidevice tests run in this session")
    files = [Path(__file__), Path(__file__).with_name("test_communication.py"),
             Path(__file__).with_name("test_tensor_parallel.py")]
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "multidevice",
                           *map(str, files)], env=_python_env(8), cwd=ROOT, capture_output=True, text=True,
                          timeout=900)
    tail = proc.stdout[-4000:] + proc.stderr[-2000:]
    assert proc.returncode == 0, tail
    assert "skipped" not in proc.stdout and "failed" not in proc.stdout, tail
    passed = int(proc.stdout.rsplit(" passed", 1)[0].split()[-1])
    assert passed >= sum(f.read_text().count("def test_multidevice_") for f in files), tail


# ----------------------------------------------------------------------------- 8 devices

DATA = load_synthetic(num_train=512, num_test=64, input_shape=(16,), num_classes=4, seed=0)
BATCH = 32


def _train(layout, policy="mixed_f16", steps=5, accum_steps=2, poison=None, optimizer=None, fp8=None,
           reduce_dtype="auto"):
    """Trains a LayerNorm MLP ``steps`` steps on ``layout``; returns the state and last metrics."""
    model = MLP(hidden=(64, 64), num_classes=4)
    state = create_train_state(model, policy, optimizer or optax.adam(1e-2), jax.random.PRNGKey(0), DATA.sample_input(1),
                               loss_scale=precision.DynamicLossScale(2.0 ** 15, period=2), layout=layout, fp8=fp8,
                               reduce_dtype=reduce_dtype)
    step_fn = make_train_step(accum_steps=accum_steps, layout=layout, donate=False)
    metrics = None
    for i in range(steps):
        batch = DATA.train_batch(i, BATCH, seed=0)
        if poison is not None and i == poison[0]:
            batch["inputs"] = batch["inputs"].copy()
            batch["inputs"][poison[1]] = np.inf
        batch = layout.global_batch(batch, BATCH) if layout is not None else jax.device_put(batch)
        state, metrics = step_fn(state, batch)
    return state, to_host(metrics)


def _layout(data, fsdp, devices=None):
    return Layout(make_mesh(data, fsdp, devices if devices is not None else jax.devices()[:data * fsdp]),
                  fsdp_min_size=256)


def _assert_close(a, b, atol, rtol=0.0):
    for x, y in zip(jax.tree_util.tree_leaves(to_host(a)), jax.tree_util.tree_leaves(to_host(b))):
        np.testing.assert_allclose(np.asarray(x, np.float32), np.asarray(y, np.float32), rtol=rtol, atol=atol)


# Adam turns rounding differences in near-zero gradients into lr-sized steps, so
# float16's rounding (gradients reduced in float16 across devices) is compared
# under SGD; float32 under Adam. On a mesh, reduce_dtype "auto" hands float32
# param gradients to the masters: the one-device reference computes them so too.
# (mixed_fp8 with "auto": the delayed-histories test below.)
@needs8
@pytest.mark.parametrize("policy,optimizer,atol,rtol,reduce_dtype,reference_reduce", [
    ("fp32", optax.adam(1e-2), 2e-6, 0.0, "auto", "f32"),
    ("mixed_f16", optax.sgd(0.1, 0.9), 5e-4, 2 * 2.0 ** -10, "f16", "auto"),  # 2 float16 ulps
])
def test_multidevice_data_parallel_and_fsdp_match_one_device(policy, optimizer, atol, rtol, reduce_dtype,
                                                             reference_reduce):
    reference, ref_metrics = _train(None, policy, optimizer=optimizer, reduce_dtype=reference_reduce)
    one_step_less, _ = _train(None, policy, steps=4, optimizer=optimizer, reduce_dtype=reference_reduce)
    with pytest.raises(AssertionError):  # the tolerance tells one step apart
        _assert_close(one_step_less.params, reference.params, 10 * atol, 10 * rtol)
    for data, fsdp in [(8, 1), (1, 8), (2, 4)]:  # data parallel, FSDP, both at once
        state, metrics = _train(_layout(data, fsdp), policy, optimizer=optimizer, reduce_dtype=reduce_dtype)
        # Under data and FSDP at once a split param's float16 gradient is summed in two float16 stages
        # (over fsdp into each device's part, a reduce-scatter on a GPU; then across data), not in one
        # all-reduce over all 8 then a slice: a rounding more, which momentum carries (measured: params
        # within 7e-4, momentum within 4e-3, the loss within 1.1e-4 of one device after 5 steps).
        two_stages = reduce_dtype == "f16" and data > 1 and fsdp > 1
        _assert_close(state.params, reference.params, 1e-3 if two_stages else atol, rtol)
        _assert_close(state.opt_state, reference.opt_state, 5e-3 if two_stages else atol, rtol)
        assert metrics["loss_scale"] == ref_metrics["loss_scale"] and metrics["grads_finite"]
        np.testing.assert_allclose(metrics["loss"], ref_metrics["loss"], rtol=2e-4 if two_stages else 1e-4)


@needs8
@pytest.mark.parametrize("policy", ["lean_bf16", "lean_int8"])
def test_multidevice_lean_state_is_sharded_like_its_params_and_matches_one_device(policy):
    """bfloat16 params as their own masters and bfloat16 or 8-bit moments, stochastically rounded from
    bits the mesh does not change: within a bfloat16 ulp or two of one device, under FSDP too."""
    reference, _ = _train(None, policy, optimizer=optax.sgd(0.05, 0.9), reduce_dtype="f32")
    for data, fsdp in [(2, 4)]:  # data parallel and FSDP at once
        state, metrics = _train(_layout(data, fsdp), policy, optimizer=optax.sgd(0.05, 0.9))
        assert metrics["grads_finite"]
        _assert_close(state.params, reference.params, atol=1e-3, rtol=2 * 2.0 ** -8)
        if policy == "lean_bf16":
            _assert_close(state.opt_state, reference.opt_state, atol=1e-3, rtol=2 * 2.0 ** -8)
        if fsdp > 1:
            kernel = [x for x in jax.tree_util.tree_leaves(state.params) if x.ndim == 2 and x.size >= 256][0]
            assert kernel.dtype == jnp.bfloat16 and len({str(s.index) for s in kernel.addressable_shards}) == fsdp


@needs8
def test_multidevice_fp8_delayed_histories_are_the_same_on_every_mesh():
    """The amax of a sharded tensor is its global max: every mesh records the same histories, bit for bit."""
    fp8 = precision.fp8_options("delayed", history=4, min_size=0)
    reference, _ = _train(None, "mixed_fp8", fp8=fp8, reduce_dtype="f32")  # what "auto" gives on a mesh
    histories = to_host(reference.model_state[precision.FP8_COLLECTION])
    assert all(float(h[0]) > 0 for h in jax.tree_util.tree_leaves(histories))
    for data, fsdp in [(8, 1), (2, 4)]:
        state, metrics = _train(_layout(data, fsdp), "mixed_fp8", fp8=fp8)
        assert metrics["grads_finite"]
        jax.tree_util.tree_map(np.testing.assert_array_equal, to_host(state.model_state[precision.FP8_COLLECTION]),
                               histories)
        # A sharded reduction rounds its bf16 partial sums in another order, and FP8 moves such
        # differences to the next grid point: params agree to a fraction of one Adam step (lr 1e-2).
        _assert_close(state.params, reference.params, 2e-3)


@needs8
@pytest.mark.parametrize("data,fsdp", [(8, 1), (2, 4)])
def test_multidevice_steps_in_one_call_match_one_call_per_step(data, fsdp):
    layout = _layout(data, fsdp)
    step_fn = make_train_step(accum_steps=2, layout=layout, donate=False)
    singles, _ = _train(layout)
    state = create_train_state(MLP(hidden=(64, 64), num_classes=4), "mixed_f16", optax.adam(1e-2),
                               jax.random.PRNGKey(0), DATA.sample_input(1),
                               loss_scale=precision.DynamicLossScale(2.0 ** 15, period=2), layout=layout)
    multi = make_multi_step(step_fn, 3, donate=False)
    for first, count in [(0, 3), (3, 2)]:
        stack = layout.global_batch(train_batch_stack(DATA, first, count, 3, BATCH, 0), BATCH, stacked=True)
        assert stack["inputs"].sharding.spec == jax.sharding.PartitionSpec(None, ("data", "fsdp"))
        state, metrics = multi(state, stack, count)
    assert int(to_host(state.step)) == 5 and bool(to_host(metrics["grads_finite"])[1])
    _assert_close(state.params, singles.params, 0.0)
    _assert_close(state.opt_state, singles.opt_state, 0.0)


@needs8
def test_multidevice_fsdp_really_splits_params_and_optimizer_state():
    state, _ = _train(_layout(2, 4), steps=1)
    kernel = state.params["Dense_1"]["kernel"]  # 64 x 64
    split = jax.sharding.PartitionSpec(None, "fsdp")
    assert kernel.sharding.spec == split
    assert {s.data.shape for s in kernel.addressable_shards} == {(64, 16)}
    mp = precision.find_mixed_precision_state(state.opt_state)
    mu = jax.tree_util.tree_leaves(mp.inner_state[0].mu)
    assert any(getattr(m.sharding, "spec", None) == split for m in mu)
    bias = state.params["Dense_1"]["bias"]  # 64 < fsdp_min_size: replicated
    assert bias.sharding.is_fully_replicated


@needs8
@pytest.mark.parametrize("data,fsdp,reduce_dtype", [(8, 1, "auto"), (2, 4, "f16")])
def test_multidevice_one_poisoned_shard_skips_the_step_on_every_device(data, fsdp, reduce_dtype):
    """The loss scale stays global whatever dtype gradients are reduced in (f16: scaled before)."""
    layout = _layout(data, fsdp)
    before, _ = _train(layout, steps=3, reduce_dtype=reduce_dtype)
    # Row 13 of the batch lives on one device only (rows 12-15 of 32 over 8 shards).
    after, metrics = _train(layout, steps=4, poison=(3, 13), reduce_dtype=reduce_dtype)
    assert not metrics["grads_finite"]
    for x, y in zip(jax.tree_util.tree_leaves(before.params), jax.tree_util.tree_leaves(after.params)):
        for sx, sy in zip(x.addressable_shards, y.addressable_shards):
            np.testing.assert_array_equal(np.asarray(sx.data), np.asarray(sy.data))
    scale = precision.current_loss_scale(after.opt_state).loss_scale
    assert len(scale.addressable_shards) == 8
    expected = float(precision.current_loss_scale(before.opt_state).loss_scale) / 2
    assert all(float(s.data) == expected for s in scale.addressable_shards)


@needs8
def test_multidevice_checkpoints_restore_onto_another_mesh(tmp_path):
    saved, _ = _train(_layout(8, 1), steps=2)
    ckpt = Checkpointer(tmp_path / "ckpt")
    ckpt.save(saved, {"data_position": 2})
    ckpt.wait()
    template, _ = _train(_layout(2, 4), steps=0)
    restored, meta = ckpt.restore(template)
    ckpt.close()
    assert meta["data_position"] == 2
    _assert_close(restored.params, saved.params, 0)
    _assert_close(restored.opt_state, saved.opt_state, 0)
    assert restored.params["Dense_1"]["kernel"].sharding.spec == jax.sharding.PartitionSpec(None, "fsdp")


@needs8
def test_multidevice_eval_counts_every_example_once():
    layout = _layout(8, 1)
    state, _ = _train(layout, steps=1)
    eval_step = make_eval_step(layout=layout)
    batch = next(DATA.eval_batches(40))  # 40 of 64: a padded, masked last batch is 24 real rows
    sharded = eval_step(state, layout.global_batch(batch, 40))
    single = make_eval_step()(jax.device_put(to_host(state)), jax.device_put(batch))
    assert float(to_host(sharded)["count"]) == 40
    np.testing.assert_allclose(to_host(sharded)["loss_sum"], to_host(single)["loss_sum"], rtol=1e-5)


class _NNXNet(nnx.Module):
    """A user's NNX model with BatchNorm and dropout (no train keyword)."""

    def __init__(self, *, rngs):
        self.l1 = nnx.Linear(16, 64, rngs=rngs)
        self.bn = nnx.BatchNorm(64, rngs=rngs)
        self.drop = nnx.Dropout(0.1, rngs=rngs)
        self.l2 = nnx.Linear(64, 4, rngs=rngs)

    def __call__(self, x):
        return self.l2(self.drop(nnx.relu(self.bn(self.l1(x)))))


def _train_nnx(layout, steps=4):
    state = create_train_state(_NNXNet(rngs=nnx.Rngs(0)), "mixed_bf16", optax.sgd(0.1, 0.9), jax.random.PRNGKey(0),
                               DATA.sample_input(1), layout=layout)
    step_fn = make_train_step(layout=layout, donate=False)
    for i in range(steps):
        batch = DATA.train_batch(i, BATCH, seed=0)
        state, _ = step_fn(state, layout.global_batch(batch, BATCH) if layout is not None else jax.device_put(batch))
    return state


@needs8
def test_multidevice_an_nnx_model_trains_data_parallel_and_fsdp_like_one_device():
    reference = _train_nnx(None)
    with pytest.raises(AssertionError):  # the tolerance (bfloat16 rounding of the all-reduce) tells a step apart
        _assert_close(_train_nnx(None, steps=3).params, reference.params, 1e-3)
    for data, fsdp in [(8, 1), (2, 4)]:
        state = _train_nnx(_layout(data, fsdp))
        _assert_close(state.params, reference.params, 1e-3)
        _assert_close(state.model_state, reference.model_state, 1e-4)  # BatchNorm over the global batch
    assert state.params["l1"]["kernel"].sharding.spec == jax.sharding.PartitionSpec(None, "fsdp")


# ----------------------------------------------------------------------------- two processes


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _cli(*args) -> list[str]:
    return [sys.executable, "-m", "train", *args]


def _two_processes(overrides: list[str]) -> list[subprocess.CompletedProcess]:
    port = _free_port()
    procs = [subprocess.Popen(
        _cli(*overrides, f"distributed.coordinator_address=localhost:{port}", "distributed.num_processes=2",
             f"distributed.process_id={i}"), env=_python_env(2), cwd=ROOT, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True) for i in range(2)]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=600)
        results.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    return results


def _outputs(results: list[subprocess.CompletedProcess]) -> str:
    return "\n".join(f"--- process {i}: exit status {r.returncode}\n{r.stdout[-1500:]}\n{r.stderr[-2500:]}"
                     for i, r in enumerate(results))


def test_two_processes_train_checkpoint_resume_and_match_one_process(tmp_path):
    """Two jax.distributed processes (2 CPU devices each, FSDP over the 4) train
    6 steps, checkpoint, then resume to 10; one process with 4 devices trains 10
    straight. The final params agree up to float32 rounding."""
    # float32 and SGD: what is compared is the distributed runtime, not half-precision rounding or Adam's
    # amplification of it (the 8-device tests cover mixed precision).
    common = [str(ROOT / "configs" / "default.yaml"), "progress=false", "inference_dtypes=[]", "log_every=2",
              "checkpoint_every=3", "data.batch_size=32", "mesh.fsdp=2", "mesh.fsdp_min_size=64",
              "precision.policy=fp32", "optimizer.name=sgd", "optimizer.lr=0.05", "optimizer.warmup_steps=0",
              "optimizer.schedule=constant"]  # a schedule spanning `steps` would change when steps grows
    multi = str(tmp_path / "multi")
    for steps in (6, 10):
        # Calls of up to 4 steps: each process feeds its rows of a stack of batches.
        results = _two_processes(common + [f"workdir={multi}", f"steps={steps}", "steps_per_call=4"])
        # Both processes' output: when one fails, the other typically reports only a secondary error
        # (a failed shutdown barrier or collective), so the first failure alone hides the cause.
        assert all(r.returncode == 0 for r in results), _outputs(results)
        assert "4 cpu devices in 2 processes, mesh data=2 fsdp=2" in results[0].stdout
        assert "summary" not in results[1].stdout and "mesh data" not in results[1].stdout  # process 0 reports
    assert "resuming from the checkpoint at step 6" in results[0].stdout
    single = str(tmp_path / "single")
    r = subprocess.run(_cli(*common, f"workdir={single}", "steps=10"), env=_python_env(4), cwd=ROOT,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "4 cpu devices, mesh data=2 fsdp=2" in r.stdout

    _assert_close(saved_state(multi, 10)[1]["params"], saved_state(single, 10)[1]["params"], 1e-5)
    lines = (Path(multi) / "metrics.jsonl").read_text().splitlines()
    assert len([line for line in lines if '"kind": "train"' in line]) == 5  # one writer, no duplicates


@needs8
def test_multidevice_diagnose_runs_on_the_configs_mesh_and_finds_what_one_device_finds(tmp_path, monkeypatch):
    """``--diagnose`` on a mesh config: the state sharded (FSDP) and the batch split as a run places
    them, each probed segment partitioned as its arrays are; the diagnosis is one device's."""
    from train.experiment.builders import build_train_state
    from train.inspections.checkup import diagnose_experiment
    from train.training.diagnose import diagnose_state
    from train.experiment.loop import build_experiment

    spec = {"steps": 1, "progress": False, "inference_dtypes": [], "compile_cache": None, "model": {"name": "mlp", "hidden": [64]},
            "data": {"name": "digits", "batch_size": 16, "eval_batch_size": 16, "eval_batches": 1},
            "precision": {"policy": "mixed_f16", "loss_scale": "dynamic"}}
    from precision.doctor import probe

    compile_segment, placed = probe._compile, set()

    def spy(part, values, *rest):  # the arrays each probed segment is compiled for
        placed.update(str(getattr(v.sharding, "spec", None)) for v in values if isinstance(v, jax.Array) and v.ndim == 2)
        return compile_segment(part, values, *rest)

    monkeypatch.setattr(probe, "_compile", spy)
    config = from_dict({**spec, "workdir": str(tmp_path), "mesh": {"data": 2, "fsdp": 4, "fsdp_min_size": 64}})
    with open(os.devnull, "w") as quiet:
        sharded, _ = diagnose_experiment(config, out=quiet)
    assert "P(None, 'fsdp')" in placed, placed  # the kernels, split as the run splits them
    data, task, model = build_experiment(config)
    state, _ = build_train_state(config, model, data)  # one device
    single = diagnose_state(state, data.train_batch(0, 16, config.seed), task)
    assert sharded.healthy == single.healthy and sharded.problems == single.problems, (str(sharded), str(single))
    rows = {(m.path, m.backward): m.amax for m in single.findings.modules}
    for m in sharded.findings.modules:
        np.testing.assert_allclose(m.amax, rows[(m.path, m.backward)], rtol=1e-2)
