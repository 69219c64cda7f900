"""Experiments end to end: CLI, outputs, resume bit for bit, the non-finite stop rule."""

import io
import json
import os
import subprocess
import sys

import jax
import pytest
import yaml

from helpers import assert_bitwise_equal, saved_leaves, saved_state
from train import Checkpointer, ConfigError, NonFiniteError, read_metrics, run
from train.cli import main
from train.config import from_dict

TINY = {
    "steps": 8, "log_every": 2, "eval_every": 4, "checkpoint_every": 4, "progress": False,
    "inference_dtypes": [],
    "model": {"name": "resnet", "stage_sizes": [1], "width": 4},
    "data": {"name": "digits", "batch_size": 8, "eval_batch_size": 100, "eval_batches": 1, "prefetch": 1},
    "optimizer": {"name": "adamw", "lr": 3e-3, "weight_decay": 1e-4},
    "accum_steps": 2,
    "precision": {"policy": "mixed_f16", "loss_scale": "dynamic", "growth_interval": 3},
}


def _config(workdir, **changes):
    raw = json.loads(json.dumps(TINY))
    raw["workdir"] = str(workdir)
    for key, value in changes.items():
        node = raw
        *parents, last = key.split(".")
        for part in parents:
            node = node[part]
        node[last] = value
    return from_dict(raw)


def test_run_writes_metrics_config_checkpoints_and_summary(tmp_path, capsys):
    summary = run(_config(tmp_path / "run", inference_dtypes=["float16"]))
    out = capsys.readouterr().out
    assert "== summary" in out and "steps/s" in out and "loss scale" in out
    workdir = tmp_path / "run"
    records = read_metrics(str(workdir))
    train = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train] == [2, 4, 6, 8]
    for r in train:
        assert {"step", "loss", "loss_scale", "grads_finite", "grad_norm", "learning_rate"} <= set(r)
    assert [r["step"] for r in records if r["kind"] == "eval"] == [4, 8]
    assert {r["dtype"] for r in records if r["kind"] == "inference"} == {"float32", "float16"}
    saved = yaml.safe_load((workdir / "config.yaml").read_text())
    assert saved["model"]["num_classes"] == 10 and saved["precision"]["policy"] == "mixed_f16"
    assert sorted(os.listdir(workdir / "checkpoints")) == ["4", "8"]
    assert any(name.startswith("events.out.tfevents") for name in os.listdir(workdir / "tensorboard"))
    assert json.loads((workdir / "summary.json").read_text())["steps"] == summary["steps"] == 8
    assert summary["loss_scale"]["increases"] >= 1  # growth_interval 3 over 8 finite steps


def test_an_interrupted_run_resumes_to_the_same_params_bit_for_bit(tmp_path):
    run(_config(tmp_path / "straight"))

    def interrupt(record):
        if record["kind"] == "train" and record["step"] == 6:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt, match="saved a checkpoint at step 7"):  # one step ran ahead of the log
        run(_config(tmp_path / "resumed"), on_record=interrupt)
    assert Checkpointer(tmp_path / "resumed" / "checkpoints").latest_step() == 7
    interrupted = [r for r in read_metrics(str(tmp_path / "resumed")) if r["kind"] == "interrupted"]
    assert [r["step"] for r in interrupted] == [7]  # issue 39 (14): the step of the checkpoint, not of the log
    run(_config(tmp_path / "resumed"))
    step_a, a = saved_leaves(tmp_path / "straight")
    step_b, b = saved_leaves(tmp_path / "resumed")
    assert step_a == step_b == 8
    assert_bitwise_equal(a, b)


def test_a_larger_steps_continues_a_finished_run(tmp_path):
    run(_config(tmp_path / "straight"))
    run(_config(tmp_path / "extended", steps=4))
    run(_config(tmp_path / "extended", steps=8))
    assert_bitwise_equal(saved_leaves(tmp_path / "straight")[1], saved_leaves(tmp_path / "extended")[1])
    steps = [r["step"] for r in read_metrics(str(tmp_path / "extended")) if r["kind"] == "train"]
    assert steps == [2, 4, 6, 8]
    out = io.StringIO()  # issue 39 (13): fewer steps than done: nothing to train, and what to do instead
    run(_config(tmp_path / "extended", steps=3), out=out)
    assert ("no training this run (the workdir's checkpoint is at step 8, at or past steps=3: give a higher steps to "
            "continue it, or a new workdir= to start afresh)") in out.getvalue()


def test_a_different_experiment_in_the_same_workdir_is_refused(tmp_path):
    run(_config(tmp_path / "run", steps=2))
    with pytest.raises(ConfigError, match=r"different experiment \(optimizer.lr: 0.003 -> 0.01\)"):
        run(_config(tmp_path / "run", **{"optimizer.lr": 1e-2}))


def test_nonfinite_gradients_at_the_minimum_scale_stop_with_the_param_path(tmp_path, doctor_off):
    config = _config(tmp_path / "run", steps=20, checkpoint_every=2, max_nonfinite_steps=3,
                     **{"precision.loss_scale": "static", "precision.initial_scale": 1e30})
    with pytest.raises(NonFiniteError) as info:
        run(config)
    message = str(info.value)
    # The rule fires reading step 3's metrics; the loop has run step 4 by then: the step it reports is the one it saved.
    assert "stopped at step 4" in message and "3 consecutive steps (since step 1)" in message
    assert "params/" in message and "minimum loss scale 1e+30" in message
    error = [r for r in read_metrics(str(tmp_path / "run")) if r["kind"] == "error"]
    assert error and error[0]["param"].startswith("params/") and error[0]["first_nonfinite_step"] == 1
    ckpt = Checkpointer(tmp_path / "run" / "checkpoints")
    # The state at the stop is checkpointed; every step was skipped, so its
    # params are the initial ones, bit for bit.
    assert ckpt.all_steps() == [2, 4] and "checkpointed at step 4" in message
    ckpt.close()
    assert_bitwise_equal(jax.tree_util.tree_leaves(saved_state(tmp_path / "run", 2)[1]["params"]),
                          jax.tree_util.tree_leaves(saved_state(tmp_path / "run", 4)[1]["params"]))


def test_cli_runs_a_config_with_overrides(tmp_path, capsys):
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(TINY))
    assert main([str(path), "steps=2", f"workdir={tmp_path / 'cli'}", "optimizer.lr=1e-3",
                 "precision.policy=mixed_bf16", "model.width=2"]) == 0
    saved = yaml.safe_load((tmp_path / "cli" / "config.yaml").read_text())
    assert saved["steps"] == 2 and saved["optimizer"]["lr"] == 1e-3 and saved["model"]["width"] == 2
    assert saved["precision"]["policy"] == "mixed_bf16"
    assert "== summary: resnet on digits, policy mixed_bf16" in capsys.readouterr().out


def test_python_m_train_default_config_entry_point(tmp_path):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-m", "train", "configs/default.yaml", "steps=3", "log_every=1",
                           f"workdir={tmp_path / 'default'}", "inference_dtypes=[]"],
                          capture_output=True, text=True, cwd=root, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "== summary: mlp on digits, policy mixed_f16" in proc.stdout
    assert "Traceback" not in proc.stderr


def test_a_run_resumes_after_its_model_gained_fields(tmp_path):
    run(_config(tmp_path / "run", steps=2))
    path = tmp_path / "run" / "config.yaml"
    old = yaml.safe_load(path.read_text())
    del old["model"]["dtype"]  # as written before the model had this field
    path.write_text(yaml.safe_dump(old))
    run(_config(tmp_path / "run", steps=3))


NAN_CODE = '''
import jax, jax.numpy as jnp, optax
import flax.linen as nn

class NanGradients(nn.Module):  # its forward pass makes a NaN every step, whatever the loss scale
    num_classes: int = 10
    @nn.compact
    def __call__(self, x):
        x = x.reshape(x.shape[0], -1)
        w = self.param("w", nn.initializers.ones, (x.shape[1], self.num_classes))
        return x @ w + jnp.log(-jnp.abs(w[0]))

def nan_loss(outputs, batch):  # a NaN the gradients never see
    loss = optax.softmax_cross_entropy_with_integer_labels(outputs, batch["labels"]).mean()
    return loss + jax.lax.stop_gradient(jnp.float32(jnp.nan)), {}
'''


def test_the_stop_rule_counts_steps_at_the_minimum_scale_and_names_it(tmp_path, doctor_off):
    """A dynamic scale from 16 down to its minimum 1 (four halvings): the rule counts the steps computed at 1,
    not the one that first reached it, and says 1."""
    (tmp_path / "nan_code.py").write_text(NAN_CODE)
    config = _config(tmp_path / "run", steps=30, max_nonfinite_steps=3, accum_steps=1,
                     **{"model": {"name": f"{tmp_path}/nan_code.py:NanGradients"},
                        "precision.initial_scale": 16.0, "precision.min_scale": 1.0})
    with pytest.raises(NonFiniteError) as info:
        run(config)
    message = str(info.value)
    assert "3 consecutive steps (since step 5) at the minimum loss scale 1 " in message
    assert "the first non-finite gradient was in params/" in message
    error = [r for r in read_metrics(str(tmp_path / "run")) if r["kind"] == "error"][0]
    assert error["step"] == 7 and error["first_nonfinite_step"] == 5


@pytest.mark.parametrize("loss_scale", ["none", "dynamic"])
def test_a_loss_that_is_not_finite_skips_the_step_even_with_finite_gradients(tmp_path, loss_scale, doctor_off):
    """Issue 39 (6): a NaN loss with finite gradients was reported as non-finite gradients, its
    streak counted from the step the scale bottomed out, and the scale halved 15 times."""
    (tmp_path / "nan_code.py").write_text(NAN_CODE)
    config = _config(tmp_path / "run", steps=30, max_nonfinite_steps=4, accum_steps=1, log_every=1,
                     **{"task": f"{tmp_path}/nan_code.py:nan_loss", "precision.loss_scale": loss_scale})
    with pytest.raises(NonFiniteError) as stop:
        run(config)
    message = str(stop.value)
    assert message.startswith("training stopped at step 4: the loss itself was non-finite, while its gradients were "
                              "finite, for 4 consecutive "
                              "steps (since step 1; max_nonfinite_steps=4): no loss scale can fix that.")
    assert "gradients were non-finite" not in message
    train_records = [r for r in read_metrics(str(tmp_path / "run")) if r["kind"] == "train"]
    assert [r["step"] for r in train_records] == [1, 2, 3, 4] and all(not r["grads_finite"] for r in train_records)
    assert train_records[-1]["skipped_steps"] == 4
    assert {r["loss_scale"] for r in train_records} == {1.0 if loss_scale == "none" else 2.0 ** 15}  # never lowered


def test_a_norm_that_overflows_while_every_gradient_is_finite_names_the_largest():
    from types import SimpleNamespace

    import jax.numpy as jnp
    from precision.optim import _first_nonfinite_leaf
    from train.tracking.tracker import Tracker

    grads = {"a": jnp.array([1.0]), "b": jnp.array([1.5e19]), "c": jnp.array([1.4e19])}  # squares: 2.25e38 + 1.96e38
    leaf = int(_first_nonfinite_leaf(grads, jnp.array(False)))
    assert leaf == -2 - 1  # every leaf finite, b the largest
    tracker = SimpleNamespace(leaf_paths=["params/a", "params/b", "params/c"])
    tracker._leaf_path = lambda i: Tracker._leaf_path(tracker, i)
    assert Tracker._culprit(tracker, leaf) == ("every gradient was finite but their global norm overflowed float32, "
                                               "the largest in params/b")


def _interrupt_cli(args, wait_for):
    """``python -m train ARGS``, Ctrl-C once ``wait_for`` is printed: (exit status, seconds to exit, stdout, stderr)."""
    import signal
    import subprocess
    import sys
    import time

    from helpers import ROOT, interruptible, subprocess_env

    proc = subprocess.Popen(interruptible("train", *args), cwd=ROOT, env=subprocess_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines = []
    while not any(wait_for in line for line in lines):
        line = proc.stdout.readline()
        assert line, f"exited before printing {wait_for!r}: {proc.stderr.read()[-2000:]}"
        lines.append(line)
    time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    start = time.perf_counter()
    out, err = proc.communicate(timeout=120)
    return proc.returncode, time.perf_counter() - start, "".join(lines) + out, err


def test_ctrl_c_is_no_error_it_says_what_was_saved_and_how_to_resume(tmp_path):
    """Issue 39 (14)."""
    code, _, out, err = _interrupt_cli(["configs/default.yaml", f"workdir={tmp_path}", "steps=100000", "progress=false",
                                        "log_every=1", "compile_cache=null"], "workdir")
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 130 and len(lines) == 1 and not lines[0].startswith("error"), err
    assert lines[0].startswith("interrupted; saved a checkpoint at step ")
    assert lines[0].endswith("; rerun the same command to resume")
    step = int(lines[0].split("at step ")[1].split(" ")[0])
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["kind"] == "interrupted" and records[-1]["step"] == step


def test_a_huge_model_says_so_before_tracing_and_ctrl_c_stops_it_at_once(tmp_path):
    """Issue 39 (10): 2,000 hidden layers traced for minutes in silence."""
    hidden = "[" + ",".join(["8"] * 2000) + "]"
    code, seconds, out, err = _interrupt_cli(["configs/default.yaml", f"workdir={tmp_path}", f"model.hidden={hidden}",
                                              "model.layer_norm=false"], "param arrays in")
    assert "model 'mlp': 4,002 param arrays in 2,001 modules" in out and "takes minutes (Ctrl-C stops it)" in out
    assert code == 130 and seconds < 10 and err.strip() == "interrupted" and "Traceback" not in err


def test_an_error_that_follows_a_ctrl_c_is_the_interruption_not_a_config_error(monkeypatch, capsys, ctrl_c_raises):
    """CI, 2026-11-28: a press that landed inside the model's trace came out as the model check's
    error (exit 2, 'error: model ... raised'); after a press, whatever a check says is the press."""
    import os
    import signal
    import time

    import train.experiment.loop as loop
    from train.cli import main
    from train.config import ConfigError

    def press_inside_a_trace(config):
        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)
        except KeyboardInterrupt as e:  # what JAX and the model checks may make of it
            raise ConfigError(f"model 'mlp' raised {type(e).__name__}") from None
        raise AssertionError("the press was not raised")

    monkeypatch.setattr(loop, "check_experiment", press_inside_a_trace)
    assert main(["configs/default.yaml", "--check"]) == 130
    assert capsys.readouterr().err.strip() == "interrupted"
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler

    def not_pressed(config):
        raise ConfigError("model 'mlp' has no parameters")

    monkeypatch.setattr(loop, "check_experiment", not_pressed)
    assert main(["configs/default.yaml", "--check"]) == 2
    assert capsys.readouterr().err == "error: configs/default.yaml: model 'mlp' has no parameters\n"


def test_a_ctrl_c_while_training_is_noted_and_raised_between_device_calls(ctrl_c_raises):
    """Raised wherever Python happened to be, a Ctrl-C that lands in JAX's garbage-collection
    callback is 'exception ignored' and the run trains on (seen: 1 in 7 presses on a loaded
    machine); the loop takes it between device calls instead. A second press raises at once."""
    import os
    import signal
    import time

    from train.experiment.interrupts import interrupts_between_calls

    with interrupts_between_calls() as interrupted:
        interrupted()  # nothing pressed: nothing raised
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.05)  # the handler ran: noted only
        with pytest.raises(KeyboardInterrupt):
            interrupted()
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)  # the second press
            time.sleep(0.05)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def _press_ctrl_c_here():
    import os
    import signal

    os.kill(os.getpid(), signal.SIGINT)
    for _ in range(1000):  # Python runs the handler at a bytecode in here, inside the callback
        pass


def _collect_with_a_press_in_a_gc_callback():
    import gc

    def press_during_collection(phase, info):
        if phase == "start":
            _press_ctrl_c_here()

    gc.callbacks.append(press_during_collection)
    try:
        gc.collect()
    finally:
        gc.callbacks.remove(press_during_collection)


def _drop_an_object_with_a_press_in_its_weakref_callback():
    import weakref

    class Thing:
        pass

    thing = Thing()
    ref = weakref.ref(thing, lambda _: _press_ctrl_c_here())
    del thing
    return ref


@pytest.mark.parametrize(
    "swallowing_place",
    [_collect_with_a_press_in_a_gc_callback, _drop_an_object_with_a_press_in_its_weakref_callback],
    ids=["gc callback", "weakref callback"],
)
def test_a_ctrl_c_landing_where_python_swallows_exceptions_is_delivered_after_it(swallowing_place, ctrl_c_raises):
    """Python swallows an exception raised in a gc or weakref callback ("exception ignored"),
    so a Ctrl-C handled there was lost and tracing or training went on. It is raised again."""
    import time

    from train.experiment.interrupts import reliable_interrupts

    with reliable_interrupts(), pytest.raises(KeyboardInterrupt):
        swallowing_place()
        time.sleep(2)  # delivered again here


def test_a_run_started_with_ctrl_c_ignored_keeps_it_ignored_and_restores_what_it_found():
    """A background job of a script, or a supervisor, starts the run with SIGINT ignored: a
    Ctrl-C meant for the terminal's foreground command must not stop it (it did: the CLI put
    its own handler in), and the handlers must leave SIGINT as they found it."""
    import os
    import signal
    import time

    from train.experiment.interrupts import interrupts_between_calls, reliable_interrupts

    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with reliable_interrupts() as pressed, interrupts_between_calls() as interrupted:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)
            interrupted()  # not noted: nothing raised
            assert not pressed()
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    except KeyboardInterrupt:
        pytest.fail("a Ctrl-C the process was started ignoring stopped it")
    finally:
        signal.signal(signal.SIGINT, previous)
