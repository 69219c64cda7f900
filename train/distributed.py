"""Devices and processes: JAX's distributed runtime, the device mesh, and how the
train state and batches are laid out over it.

One mesh with two axes, ``("data", "fsdp")``:

* batches are split over both axes (every device sees its own examples);
* params and optimizer state are replicated over ``data`` and, when
  ``fsdp > 1``, each array at least ``fsdp_min_size`` elements large is split
  along its last dimension that ``fsdp`` divides (FSDP / ZeRO-3 style). The
  train step gathers params where the model uses them and sums the gradients
  back to the split layout.

Everything is a sharding annotation on ordinary ``jax.jit`` programs (no
``pmap``), so reductions such as the global gradient norm and the finiteness
check that decides whether a step is skipped are computed over the whole
global batch: every device takes the same decision and keeps the same loss
scale.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import os
import socket
import sys
import time
from typing import Any, Iterator

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from precision.autocast.fp8_quantize import E4M3, dequantized, e4m3_read

__all__ = ["DATA_AXES", "GATHER_SCOPE", "Layout", "MeshError", "host_rows", "initialize_distributed", "make_mesh", "to_host"]

#: The mesh axes a batch is split over.
DATA_AXES = ("data", "fsdp")
#: The named scope of the params' all-gathers (how :func:`train.explain_communication` knows them).
GATHER_SCOPE = "gather_params"


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
    with _aborts_reported(f"distributed: not all {num_processes} processes connected to the coordinator at "
                          f"{coordinator_address} within {timeout_seconds} s (distributed.timeout_seconds): start "
                          f"every process with the same distributed.* settings, or wait longer"):
        jax.distributed.initialize(coordinator_address, num_processes, process_id,
                                   initialization_timeout=timeout_seconds)
    # Leave through the shutdown barrier while everything is still alive: JAX does not shut its
    # runtime down at exit, and interpreter teardown may destroy process 0's coordination service
    # while the others are still in their barrier ("Shutdown barrier has failed", seen on jax 0.11).
    # Registered now, it runs after the exit handlers registered later (orbax's async saves).
    atexit.register(jax.distributed.shutdown)
    return True


#: What JAX's distributed client writes before it aborts the process (a C++ stack trace follows).
_FATAL = (b"Terminating process because the JAX distributed service", b"*** Check failure stack trace")


@contextlib.contextmanager
def _aborts_reported(message: str) -> Iterator[None]:
    """Runs the body with this process's stderr passing through a small watchdog
    process: JAX's distributed client does not raise when the processes fail to
    connect, it aborts the process with a C++ stack trace. The watchdog turns that
    into ``error: <message>`` (one line) and passes anything else through."""
    read, write = os.pipe()
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
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)  # the pipe's last writer gone: the watchdog reads to the end and leaves
        os.close(saved)
        os.waitpid(child, 0)


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


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    if value in (None, ""):
        return None
    try:
        return int(value)
    except ValueError:
        raise MeshError(f"environment variable {name} must be an integer, got {value!r}") from None


def make_mesh(data: int = -1, fsdp: int = 1, devices: Any = None) -> Mesh:
    """A ``("data", "fsdp")`` mesh over ``devices`` (default: every device of every process).

    ``data=-1`` takes all the devices ``fsdp`` leaves. The product must equal
    the device count.
    """
    devices = list(jax.devices() if devices is None else devices)
    count = len(devices)
    if fsdp < 1 or (data < 1 and data != -1):
        raise MeshError(f"mesh.data must be >= 1 or -1 (all devices) and mesh.fsdp >= 1; got data={data}, "
                        f"fsdp={fsdp}")
    if data == -1:
        if count % fsdp:
            raise MeshError(f"mesh.fsdp={fsdp} does not divide the {count} devices")
        data = count // fsdp
    if data * fsdp != count:
        raise MeshError(f"mesh.data * mesh.fsdp = {data} * {fsdp} = {data * fsdp}, but there are {count} "
                        f"devices ({_describe(devices)}); use mesh.data=-1 to take all of them, or set "
                        f"XLA_FLAGS=--xla_force_host_platform_device_count=N for N CPU devices")
    # Devices of one process stay adjacent along the data axis, so each process
    # feeds a contiguous block of the batch.
    ordered = sorted(devices, key=lambda d: (d.process_index, d.id))
    return Mesh(np.array(ordered, dtype=object).reshape(data, fsdp), ("data", "fsdp"))


def _describe(devices: list) -> str:
    kinds = sorted({d.platform for d in devices})
    processes = len({d.process_index for d in devices})
    return f"{'/'.join(kinds)} over {processes} process{'es' if processes > 1 else ''}"


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where each array of a training run lives on ``mesh``.

    ``fsdp_min_size``: arrays with fewer elements stay replicated even when
    ``fsdp > 1`` (splitting a bias costs more in collectives than it saves).
    """

    mesh: Mesh
    fsdp_min_size: int = 1024

    @property
    def data_shards(self) -> int:
        """How many ways a batch is split."""
        return self.mesh.devices.size

    @property
    def fsdp(self) -> int:
        return self.mesh.shape["fsdp"]

    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, PartitionSpec())

    def batch(self) -> NamedSharding:
        """Leading (example) dimension split over every device."""
        return NamedSharding(self.mesh, PartitionSpec(DATA_AXES))

    def param_spec(self, shape: tuple[int, ...]) -> PartitionSpec:
        """Replicated, or split over ``fsdp`` along the last dimension it divides
        (the output features of Dense and Conv kernels)."""
        if self.fsdp == 1 or int(np.prod(shape, dtype=np.int64)) < self.fsdp_min_size:
            return PartitionSpec()
        candidates = [i for i, n in enumerate(shape) if n % self.fsdp == 0]
        if not candidates:
            return PartitionSpec()
        axis = candidates[-1]
        return PartitionSpec(*([None] * axis + ["fsdp"]))

    def state(self, tree: Any) -> Any:
        """Shardings for every array of ``tree`` (a train state, params, optimizer state)."""
        return jax.tree_util.tree_map(lambda x: NamedSharding(self.mesh, self.param_spec(np.shape(x))), tree)

    def constrain_state(self, tree: Any) -> Any:
        """Inside ``jit``: pins ``tree``'s arrays to their layout."""
        return jax.lax.with_sharding_constraint(tree, self.state(tree))

    def gather(self, tree: Any, dtypes: Any = None) -> Any:
        """Inside ``jit``: the whole arrays of an FSDP-split ``tree`` on every device.

        Params are gathered where the model uses them, so the forward and
        backward passes compute exactly as under data parallelism (no
        half-precision partial sums across devices) and only the stored copies
        (params, float32 masters, optimizer moments) stay split.

        ``dtypes`` (a tree like ``tree``, from :func:`precision.read_dtypes`):
        each split array is cast to its dtype on its own shard, before the
        all-gather, so a param the model only reads in bfloat16 crosses the
        wire in bfloat16. An optimization barrier keeps XLA from moving the
        cast after the gather (jax#23543).
        """
        if self.fsdp == 1:
            return tree
        if dtypes is None:
            dtypes = jax.tree_util.tree_map(lambda x: x.dtype, tree)
        with jax.named_scope(GATHER_SCOPE):
            return jax.tree_util.tree_map(lambda x, dtype: _gather(x, np.dtype(dtype), self.replicated()),
                                          tree, dtypes)

    def constrain_batch(self, tree: Any) -> Any:
        """Inside ``jit``: pins a batch's leading dimension to the data axes."""
        return jax.lax.with_sharding_constraint(tree, jax.tree_util.tree_map(lambda _: self.batch(), tree))

    def put_state(self, tree: Any) -> Any:
        """Places a state (built on one device, or restored) on the mesh."""
        return jax.device_put(tree, self.state(tree))

    def check_batch_size(self, batch_size: int, what: str = "data.batch_size") -> None:
        """Raises :class:`MeshError` unless ``batch_size`` splits evenly over the data shards."""
        if batch_size % self.data_shards:
            raise MeshError(f"{what}={batch_size} does not split over the {self.data_shards} devices of the "
                            f"mesh {dict(self.mesh.shape)}; use a multiple of {self.data_shards}")

    def global_batch(self, local: Any, global_size: int, stacked: bool = False) -> Any:
        """A global batch array from this process's rows (see :func:`host_rows`).

        ``stacked``: ``local`` stacks several batches along a new leading axis
        (the input of :func:`train.make_multi_step`); the rows are the second axis.
        """
        sharding = NamedSharding(self.mesh, PartitionSpec(None, DATA_AXES)) if stacked else self.batch()
        if jax.process_count() == 1:  # every row is local: one transfer for the whole batch
            return jax.device_put(local, sharding)
        lead = 1 if stacked else 0

        def make(x):
            x = np.asarray(x)
            shape = x.shape[:lead] + (global_size,) + x.shape[lead + 1:]
            return jax.make_array_from_process_local_data(sharding, x, shape)

        return jax.tree_util.tree_map(make, local)


def _gather(x: Any, dtype: np.dtype, replicated: NamedSharding) -> Any:
    """``x`` whole on every device, gathered in ``dtype`` (cast on each shard first).

    A narrower gather still hands the model an array of ``x``'s dtype (holding the
    narrow values, which the model casts back exactly where it reads them), and
    its derivative passes the cotangent through unrounded: a param's gradient,
    reduced across devices in ``reduce_dtype``, reaches its float32 master
    without a round trip through the gather's dtype, and the reduction is
    followed by nothing but the slice of each device's part."""
    if x.dtype == dtype:
        return jax.lax.with_sharding_constraint(x, replicated)
    if dtype == E4M3:  # quantized with the whole array's scale, the model handed its dequantized values
        return _narrow_gather(x, lambda x: e4m3_read(x)[:2], lambda q: dequantized(*q, x.dtype), replicated)
    return _narrow_gather(x, lambda x: x.astype(dtype), lambda narrow: narrow.astype(x.dtype), replicated)


def _narrow_gather(x: Any, narrow: Any, widen: Any, replicated: NamedSharding) -> Any:
    """``widen(gathered narrow(x))``: ``narrow`` on each shard, the all-gather of what it
    returns, ``widen`` after. Optimization barriers keep XLA from moving the narrowing
    after the gather (jax#23543). The cotangent passes through unrounded.

    FP8 (E4M3, ``e4m3_read``): each shard is quantized with the scale of the whole array
    (its amax reduced across devices: every device makes the same bits), one byte per
    element crosses the wire, and the model's FP8 matmul quantizes the dequantized values
    to the same FP8 values (:mod:`precision.reads`)."""

    @jax.custom_vjp
    def gather(x):
        payload = jax.lax.optimization_barrier(narrow(x))
        return widen(jax.lax.optimization_barrier(jax.lax.with_sharding_constraint(payload, replicated)))

    gather.defvjp(lambda x: (gather(x), None), lambda _, g: (jax.lax.with_sharding_constraint(g, replicated),))
    return gather(x)


def host_rows(global_size: int) -> slice:
    """The rows of a global batch that this process reads and feeds.

    Processes own equal, contiguous blocks in process order, matching the device
    order of :func:`make_mesh`, so every example is read by exactly one process.
    """
    count, index = jax.process_count(), jax.process_index()
    if global_size % count:
        raise MeshError(f"batch of {global_size} does not split over {count} processes")
    per = global_size // count
    return slice(index * per, (index + 1) * per)


def to_host(tree: Any) -> Any:
    """Numpy copies of (replicated or fully addressable) arrays, on every process,
    in one transfer.

    Metrics, loss scales and eval sums are replicated, so each process reads its
    own copy; no cross-process traffic.
    """

    def local(x):
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            if not x.is_fully_replicated:
                raise ValueError(f"to_host: array of shape {x.shape} is split across processes; gather it first")
            return x.addressable_shards[0].data
        return x

    return jax.device_get(jax.tree_util.tree_map(local, tree))
