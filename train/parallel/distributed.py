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

import contextlib

import dataclasses
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from precision.autocast.scaled.fp8_quantize import E4M3, dequantized, e4m3_read
from train.parallel.processes import MeshError, initialize_distributed  # noqa: F401 - re-exported: the runtime a mesh spans

__all__ = ["DATA_AXES", "GATHER_SCOPE", "Layout", "MeshError", "host_rows", "initialize_distributed", "make_mesh", "to_host"]

#: The mesh axes a batch is split over.
DATA_AXES = ("data", "fsdp")
#: The named scope of the params' all-gathers (how :func:`train.explain_communication` knows them).
GATHER_SCOPE = "gather_params"


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

    def computing(self) -> Any:
        """Context for tracing the model: the mesh as JAX's abstract mesh, so a kernel that runs
        per device (the fused attention on a TPU, :mod:`precision.autocast.tpu_flash`) splits the
        batch over it as the data is split. One device: nothing."""
        if self.mesh.devices.size == 1:
            return contextlib.nullcontext()
        return jax.sharding.use_abstract_mesh(self.mesh.abstract_mesh)

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
