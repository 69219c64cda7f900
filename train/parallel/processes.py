"""Starting JAX's multi-process runtime for a run, failing in one line.

:func:`initialize_distributed` connects this process to the others (the
coordinator's address, the process count and index, from the config or the
cluster's environment) before anything touches a device, as JAX requires. What
goes wrong there (a coordinator nobody reaches, a port another program holds, a
process that never arrives) ends the process with one line and exit status 2,
never a C++ abort or a stack trace (:class:`MeshError`).
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import os
import socket
import sys
import time
from typing import Iterator

import jax

__all__ = ["MeshError", "initialize_distributed", "ABORT_EXIT_STATUS"]


class MeshError(ValueError):
    """The requested mesh or distributed setup does not fit the devices or processes."""


def initialize_distributed(coordinator_address: str | None = None, num_processes: int | None = None,
                           process_id: int | None = None, *, cluster_detect: bool = False,
                           timeout_seconds: int = 300) -> bool:
    """Joins JAX's multi-process runtime when asked to; returns whether it did.

    Arguments left ``None`` are read from ``JAX_COORDINATOR_ADDRESS``,
    ``JAX_NUM_PROCESSES`` and ``JAX_PROCESS_ID``. With none of them set and
    ``cluster_detect`` false this is a single-process run and nothing happens;
    with ``cluster_detect`` JAX detects the cluster (SLURM, Open MPI,
    Kubernetes, TPU pods) itself. On CPU, cross-process collectives use gloo.
    Must run before anything touches a JAX device.
    """
    coordinator_address = coordinator_address or os.environ.get("JAX_COORDINATOR_ADDRESS") or None
    num_processes = num_processes if num_processes is not None else _env_int("JAX_NUM_PROCESSES")
    process_id = process_id if process_id is not None else _env_int("JAX_PROCESS_ID")
    explicit = coordinator_address is not None or num_processes is not None or process_id is not None
    if not explicit and not cluster_detect:
        return False
    if explicit and (coordinator_address is None or num_processes is None or process_id is None):
        missing = [name for name, value in (("coordinator_address", coordinator_address),
                                            ("num_processes", num_processes), ("process_id", process_id))
                   if value is None]
        raise MeshError(f"distributed: {', '.join(missing)} missing; a multi-process run needs "
                        f"coordinator_address, num_processes and process_id (config distributed.* or "
                        f"JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID), or "
                        f"distributed.cluster_detect=true on SLURM / Open MPI / Kubernetes")
    if explicit and not 0 <= process_id < num_processes:
        raise MeshError(f"distributed.process_id must lie in [0, num_processes={num_processes}), got {process_id}")
    if jax.distributed.is_initialized():
        return True
    from jax._src import xla_bridge

    if xla_bridge.backends_are_initialized():
        raise MeshError("distributed: JAX's multi-process runtime must start before anything uses a device; "
                        "call train.initialize_distributed(...) first thing in your program (the CLI does)")
    if "cpu" in (os.environ.get("JAX_PLATFORMS") or "cpu").split(","):
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if explicit and process_id != 0:
        _wait_for_coordinator(coordinator_address, timeout_seconds)
    elif explicit:
        _check_port_free(coordinator_address)
    reach = " (process 0 runs it: its host must be reachable from here)" if process_id == 0 else ""
    with _aborts_reported(f"distributed: not all {num_processes} processes connected to the coordinator at "
                          f"{coordinator_address}{reach} within {timeout_seconds} s (distributed.timeout_seconds): "
                          f"start every process with the same distributed.* settings, or wait longer"):
        try:
            jax.distributed.initialize(coordinator_address, num_processes, process_id,
                                       initialization_timeout=timeout_seconds)
        except Exception as e:  # noqa: BLE001 - JAX's runtime did not start (e.g. the coordinator's port is taken)
            text = " ".join(str(e).split())[:300]
            hint = (f"; is port {coordinator_address.rpartition(':')[2]} of this machine taken by another program?"
                    if "Failed to start RPC server" in text else "")
            raise MeshError(f"distributed.coordinator_address {coordinator_address}: JAX's multi-process runtime "
                            f"did not start ({type(e).__name__}: {text}){hint}") from None
    # Leave through the shutdown barrier while everything is still alive: JAX does not shut its
    # runtime down at exit, and interpreter teardown may destroy process 0's coordination service
    # while the others are still in their barrier ("Shutdown barrier has failed", seen on jax 0.11).
    # Registered now, it runs after the exit handlers registered later (orbax's async saves).
    atexit.register(jax.distributed.shutdown)
    return True


#: What JAX's distributed client writes before it aborts the process (a C++ stack trace follows).
_FATAL = (b"Terminating process because the JAX distributed service", b"*** Check failure stack trace")


#: The exit status of a process whose multi-process runtime failed to start (as a bad config: nothing ran).
ABORT_EXIT_STATUS = 2


@contextlib.contextmanager
def _aborts_reported(message: str) -> Iterator[None]:
    """Runs the body with this process's stderr passing through a small watchdog
    process: JAX's distributed client does not raise when the processes fail to
    connect, it aborts the process with a C++ stack trace. The watchdog turns that
    into ``error: <message>`` (one line) and passes anything else through; the
    abort itself becomes exit status :data:`ABORT_EXIT_STATUS` (see :func:`_exit_on_abort`)."""
    read, write = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    child = os.fork()
    if child == 0:  # the watchdog: only os calls, then _exit
        os.close(write)
        _relay(read, message)
    os.close(read)
    saved = os.dup(2)
    os.dup2(write, 2)
    os.close(write)
    try:
        with _exit_on_abort(ABORT_EXIT_STATUS):
            yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)  # the pipe's last writer gone: the watchdog reads to the end and leaves
        os.close(saved)
        os.waitpid(child, 0)


@contextlib.contextmanager
def _exit_on_abort(status: int) -> Iterator[None]:
    """Runs the body with SIGABRT ending the process with exit ``status`` instead of a
    core dump (-6). JAX's client calls ``abort()`` from C++, where Python's own signal
    handlers cannot stop it (``abort`` re-raises after they return); a C-level handler
    that calls ``_exit`` can. Without ctypes or libc's ``signal`` the body runs as is."""
    try:
        import ctypes
        import signal as signals

        libc = ctypes.CDLL(None, use_errno=True)
        libc.signal.restype = ctypes.c_void_p
        handler_type = ctypes.CFUNCTYPE(None, ctypes.c_int)
    except (ImportError, OSError, AttributeError):
        yield
        return

    def on_abort(_signum: int) -> None:
        os._exit(status)  # no flush, no destructors: the C++ side is mid-abort; the watchdog has the stderr

    handler = handler_type(on_abort)  # kept alive until restored below
    previous = libc.signal(signals.SIGABRT, ctypes.cast(handler, ctypes.c_void_p))
    try:
        yield
    finally:
        libc.signal(signals.SIGABRT, ctypes.c_void_p(previous))


def _relay(fd: int, message: str) -> None:
    """The watchdog's loop: stderr passed through until a fatal line, then one line of ours."""
    pending, fatal = b"", False
    while chunk := os.read(fd, 65536):
        pending += chunk
        *lines, pending = pending.split(b"\n")
        for line in lines:
            if any(mark in line for mark in _FATAL):
                if not fatal:
                    os.write(2, f"error: {message}\n".encode())
                fatal = True
            elif not fatal:
                os.write(2, line + b"\n")
    if pending and not fatal:
        os.write(2, pending)
    os._exit(0)


def _wait_for_coordinator(address: str, timeout_seconds: float) -> None:
    """Waits until process 0's coordinator accepts connections at ``address``; a
    :class:`MeshError` naming it after ``timeout_seconds`` (where JAX's own client
    would abort the process with a C++ stack trace)."""
    host, _, port = address.rpartition(":")
    deadline = time.monotonic() + timeout_seconds
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host.strip("[]"), int(port)), timeout=min(2.0, timeout_seconds)):
                return
        except (OSError, ValueError) as e:
            last = e
            time.sleep(0.25)
    raise MeshError(f"distributed.coordinator_address {address}: no coordinator answered within {timeout_seconds} s "
                    f"({getattr(last, 'strerror', None) or last}); process 0 must run at that address and be "
                    f"reachable from here (distributed.timeout_seconds sets the wait)")


def _check_port_free(address: str) -> None:
    """Process 0 serves the coordinator on ``address``'s port, on every interface: a
    :class:`MeshError` naming it when another program holds that port (where JAX's
    service would fail with a C++ log line and an exception)."""
    port = int(address.rpartition(":")[2])
    for family, host in ((socket.AF_INET6, "::"), (socket.AF_INET, "0.0.0.0")):
        try:
            with socket.socket(family, socket.SOCK_STREAM) as probe:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                probe.bind((host, port))
                return
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise MeshError(f"distributed.coordinator_address {address}: port {port} of this machine is taken "
                                f"by another program; process 0 serves the coordinator there: pick a free port"
                                ) from None
    # neither family could be probed (no IPv6, no IPv4?): left to JAX


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    if value in (None, ""):
        return None
    try:
        return int(value)
    except ValueError:
        raise MeshError(f"environment variable {name} must be an integer, got {value!r}") from None
