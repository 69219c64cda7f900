"""Weights & Biases (``tracker.wandb``), offline and without a login: a run logs its
config, the records of metrics.jsonl, the precision report and its summary; a
rerun continues the same W&B run; an interrupt finishes it with the CLI's exit
status; bad settings and a missing package fail in one line before compute; a
wandb failure while logging costs one warning, never the run.

wandb 0.31 reads its offline ``run-ID.wandb`` files only in its Go service, so
:func:`_records` reads them here: a LevelDB log of ``wandb_internal_pb2.Record``.
"""

import glob
import io
import json
import os
import struct
import sys
import time

import pytest

from train import ConfigError, WandbLogger, load_config, read_metrics, run
from train.config import from_dict
from train.tracking.wandb_logger import INSTALL_HINT

TINY = {"steps": 6, "log_every": 2, "eval_every": 3, "checkpoint_every": 3, "progress": False,
        "inference_dtypes": [], "model": {"name": "mlp", "hidden": [16]},
        "data": {"name": "digits", "batch_size": 16, "eval_batch_size": 100, "eval_batches": 1},
        "precision": {"policy": "mixed_bf16"}, "tracker": {"wandb": {"project": "test", "mode": "offline"}}}


@pytest.fixture(scope="module", autouse=True)
def offline_wandb(tmp_path_factory):
    """wandb offline with its settings, caches and data in a temporary directory: nothing
    read from or written to ~/.config, ~/.cache or ~/.netrc; no login, no network."""
    wandb = pytest.importorskip("wandb")
    home = tmp_path_factory.mktemp("wandb-home")
    with pytest.MonkeyPatch.context() as mp:
        for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_DIR"):
            mp.setenv(name, str(home / name.lower()))
        mp.setenv("WANDB_MODE", "offline")
        mp.setenv("NETRC", str(home / "netrc"))
        mp.delenv("WANDB_API_KEY", raising=False)
        wandb.teardown()  # settings are read once per process: read these
        yield
        wandb.teardown()


def _records(path):
    """The protobuf records of a ``.wandb`` file: LevelDB log blocks after a 7-byte W&B header."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, pos, pending, block = open(path, "rb").read(), 7, b"", 32768
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        pending, pos = pending + data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind in (1, 4):  # a full record, or the last piece of one
            record = pb.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def _finished_records(path, timeout=20.0):
    """The records of a finished run's file (wandb's service may still be writing its end)."""
    deadline = time.monotonic() + timeout
    while True:
        records = list(_records(path))
        if records and records[-1].WhichOneof("record_type") == "exit" or time.monotonic() > deadline:
            return records
        time.sleep(0.05)


def _read_run(workdir):
    """The W&B runs under ``WORKDIR/wandb`` in the order they ran: id, config, history {key: {step: value}},
    summary and exit code of each. (By when each file was last written: one run ends before the next starts,
    and two runs started within one second share a directory name, so names do not order them.)"""
    runs = []
    for path in sorted(glob.glob(os.path.join(workdir, "wandb", "offline-run-*", "run-*.wandb")), key=os.path.getmtime):
        out = {"config": {}, "history": {}, "summary": {}, "exit_code": None}
        for r in _finished_records(path):
            kind = r.WhichOneof("record_type")
            if kind == "run":
                out["id"] = r.run.run_id
            elif kind == "config":
                out["config"].update({u.key: json.loads(u.value_json) for u in r.config.update})
            elif kind == "history":
                items = {"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in r.history.item}
                for key, value in items.items():
                    out["history"].setdefault(key, {})[r.history.step.num] = value
            elif kind == "summary":
                out["summary"].update({"/".join(u.nested_key) or u.key: json.loads(u.value_json)
                                       for u in r.summary.update})
            elif kind == "exit":
                out["exit_code"] = r.exit.exit_code
        runs.append(out)
    return runs


def test_a_run_logs_its_config_metrics_precision_report_and_summary(tmp_path):
    out = io.StringIO()
    config = from_dict({**TINY, "workdir": str(tmp_path), "inference_dtypes": ["bfloat16"],
                        "tracker": {"tensorboard": False,
                                    "wandb": {"project": "test", "mode": "offline", "tags": ["tiny"]}}})
    summary = run(config, out=out)
    (logged,) = _read_run(tmp_path)
    assert logged["id"] == open(tmp_path / "wandb" / "run_id").read().strip() and logged["exit_code"] == 0
    assert logged["config"]["steps"] == 6 and logged["config"]["model"]["hidden"] == [16]
    assert logged["config"]["tracker"]["wandb"]["tags"] == ["tiny"]
    records = read_metrics(tmp_path)
    for kind in ("train", "eval"):  # every numeric field of every record, at its step
        for field in ("loss", "accuracy"):
            assert logged["history"][f"{kind}/{field}"] == pytest.approx(
                {r["step"]: r[field] for r in records if r["kind"] == kind})
    assert logged["history"]["train/grads_finite"] == {2: 1, 4: 1, 6: 1}
    assert logged["history"]["inference/bfloat16/accuracy"] == {6: summary["inference"]["bfloat16"]["accuracy"]}
    s = logged["summary"]
    assert s["precision/policy"] == summary["policy"] and s["precision/policy_spec"] == "mixed_bf16"
    assert s["precision/half_share"] == 1.0 and "Dense_0" in s["precision/explain"]
    assert s["precision/modules"]["_type"] == "table-file" and "precision/fp8_share" not in s
    (table,) = glob.glob(str(tmp_path / "wandb" / "offline-run-*" / "files" / "media" / "table" / "precision" / "*"))
    table = json.load(open(table))
    rows = {row[0]: dict(zip(table["columns"], row)) for row in table["data"]}
    assert rows["Dense_0"]["matmul/conv"] == "bf16" and rows["Dense_0"]["half share"] == 1.0
    assert rows["LayerNorm_0"]["params"] == "f32" and s["precision/modules"]["nrows"] == len(rows)
    assert s["final_train_loss"] == summary["final_train_loss"] and s["eval"] == summary["eval"]
    assert "wandb" not in out.getvalue()  # its chatter stays off the run's output
    assert not (tmp_path / "tensorboard").exists() and (tmp_path / "metrics.jsonl").exists()


def test_a_rerun_continues_the_wandb_run_and_an_interrupt_finishes_it_with_130(tmp_path):
    config = from_dict({**TINY, "workdir": str(tmp_path)})

    def interrupt(record):
        if record["kind"] == "train" and record["step"] == 4:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt, match="saved a checkpoint"):
        run(config, out=io.StringIO(), on_record=interrupt)
    run(config, out=io.StringIO())
    first, second = _read_run(tmp_path)
    assert first["id"] == second["id"] and (first["exit_code"], second["exit_code"]) == (130, 0)
    assert "saved a checkpoint" in first["summary"]["interrupted/message"]
    assert set(first["history"]["train/loss"]) == {2, 4} and 6 in second["history"]["train/loss"]


@pytest.mark.parametrize("given", [["tracker.wandb.mode=offline"], ["tracker.wandb.tags=[a]"]])
def test_wandb_settings_without_a_project_fail_in_one_line(tmp_path, given):
    path = tmp_path / "c.yaml"
    path.write_text("steps: 2\n")
    with pytest.raises(ConfigError, match=r"tracker.wandb.project is required .*tracker.wandb.(mode|tags) is set"):
        load_config(path, given)
    assert load_config(path, ["tracker.wandb.project=x"]).tracker.wandb.enabled  # an override switches it on
    assert not load_config(path, ["tracker.wandb.project=x", "tracker.wandb.mode=disabled"]).tracker.wandb.enabled
    config = from_dict({**TINY, "workdir": str(tmp_path / "run")})
    config.tracker.wandb = {"project": None}  # from Python: caught where the run starts, before compute
    config.tracker.wandb.mode = "offline"
    with pytest.raises(ConfigError, match="tracker.wandb.project is required"):
        run(config, out=io.StringIO())
    assert not (tmp_path / "run").exists()


def test_without_the_wandb_package_a_run_fails_in_one_line_before_compute(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb raises ImportError
    with pytest.raises(ConfigError) as error:
        run(from_dict({**TINY, "workdir": str(tmp_path / "run")}), out=io.StringIO())
    assert str(error.value) == INSTALL_HINT == ("tracker.wandb needs the wandb package: "
                                                "pip install 'flax-mixed-precision[wandb]'")
    assert not (tmp_path / "run").exists()
    run(from_dict({**TINY, "workdir": str(tmp_path / "off"), "steps": 1, "tracker": {"wandb": None}}),
        out=io.StringIO())  # without tracker.wandb the package is never asked for


def test_your_own_loop_logs_through_the_logger_and_a_wandb_failure_costs_one_warning(tmp_path, monkeypatch, capsys):
    """The logger as a context manager; wandb failing while it logs (the network, its service)."""
    workdir = str(tmp_path)
    with WandbLogger("my-project", workdir, config={"lr": 0.1}, mode="offline") as logger:
        logger.log({"kind": "train", "step": 1, "loss": 0.5, "grads_finite": True, "note": "text"})
        monkeypatch.setattr(logger.run, "log", lambda *a, **k: (_ for _ in ()).throw(ConnectionError("offline")))
        for step in (2, 3):
            logger.log({"kind": "train", "step": step, "loss": 0.25})
        logger.log_summary({"final": 1})  # after a failure: nothing more is sent
    warned = capsys.readouterr().err.splitlines()
    assert warned == ["warning: Weights & Biases failed to log (ConnectionError: offline); the run goes on without "
                      "it: metrics.jsonl keeps every record"]
    (logged,) = _read_run(tmp_path)
    assert logged["history"]["train/loss"] == {1: 0.5} and logged["history"]["train/grads_finite"] == {1: 1}
    assert logged["config"]["lr"] == 0.1 and "final" not in logged["summary"] and logged["exit_code"] == 0
    assert not logger.active
