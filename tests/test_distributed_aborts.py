"""A multi-process run whose processes cannot meet ends with one line and exit
status 2, the way a user meets it on the command line: never JAX's C++ abort
(SIGABRT, exit -6) and its stack trace, never a Python traceback."""

import socket
import subprocess
import sys

import pytest

from helpers import ROOT, subprocess_env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _train(tmp_path, port: int, process_id: int) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "train", "configs/default.yaml", f"workdir={tmp_path}/run", "--check",
         f"distributed.coordinator_address=127.0.0.1:{port}", "distributed.num_processes=2",
         f"distributed.process_id={process_id}", "distributed.timeout_seconds=1"],
        cwd=ROOT, env=subprocess_env(JAX_PLATFORMS="cpu"), capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("process_id, line", [
    (0, "error: distributed: not all 2 processes connected to the coordinator at "
        "127.0.0.1:{port} (process 0 runs it: its host must be reachable from here) within 1 s"),
    (1, "error: configs/default.yaml: distributed.coordinator_address 127.0.0.1:{port}: no coordinator answered "
        "within 1 s (Connection refused)"),
])
def test_processes_that_do_not_meet_exit_2_with_one_line(tmp_path, process_id, line):
    port = _free_port()  # process 0 waits there for process 1 in vain; process 1 finds nothing listening
    result = _train(tmp_path, port, process_id)
    assert result.returncode == 2, (result.returncode, result.stderr[-2000:])
    errors = [s for s in result.stderr.splitlines() if s.startswith("error: ")]
    assert len(errors) == 1 and errors[0].startswith(line.format(port=port)), result.stderr
    assert "Traceback" not in result.stderr and "Check failure" not in result.stderr
    assert not (tmp_path / "run").exists()


def test_process_0_on_a_taken_port_exits_2_with_one_line(tmp_path):
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = _train(tmp_path, port, 0)
    assert result.returncode == 2, (result.returncode, result.stderr[-2000:])
    assert result.stderr.strip() == (f"error: configs/default.yaml: distributed.coordinator_address 127.0.0.1:{port}: "
                                     f"port {port} of this machine is taken by another program; process 0 serves "
                                     f"the coordinator there: pick a free port")
