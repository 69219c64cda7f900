"""Devices and processes: JAX's distributed runtime, the device mesh, and how the
train state and batches are laid out over it.

One mesh with three axes, ``("data", "fsdp", "tensor")``:

* batches are split over ``data`` and ``fsdp`` (every device of those sees its own
  examples) and whole over ``tensor``;
* params and optimizer state are replicated over ``data`` and, when
  ``fsdp > 1``, each array at least ``fsdp_min_size`` elements large is split
  along its last dimension that ``fsdp`` divides (FSDP / ZeRO-3 style). The
  train step gathers params where the model uses them and sums the gradients
  back to the split layout;
* when ``tensor > 1``, the params a tensor-parallel plan names
  (:mod:`train.parallel.tensor`: the matmul pairs of attention and the MLP, the
  vocabulary) are split along one dimension over ``tensor`` as well, and stay
  split where the model computes with them (Megatron-style); ``fsdp`` takes
  another dimension of them.

``tensor`` is the innermost axis: its devices have adjacent ids, inside one
process (one host's NVLink or ICI), as it sends the most.

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

import precision
from train.parallel.gather import gather as gather_param
from train.parallel.tensor.parts import deinterleaved, interleaved
from train.parallel.tensor.plan import TensorPlan, key_names
from train.parallel.tensor.planning import tensor_pass
from train.parallel.processes import MeshError, initialize_distributed  # noqa: F401 - re-exported: the runtime a mesh spans

__all__ = ["AXES", "DATA_AXES", "GATHER_SCOPE", "Layout", "MeshError", "crossing_axes", "host_rows",
           "initialize_distributed", "make_mesh", "to_host"]

#: The mesh's axes, outermost first.
AXES = ("data", "fsdp", "tensor")

#: The mesh axes a batch is split over.
DATA_AXES = ("data", "fsdp")
#: The named scope of the params' all-gathers (how :func:`train.explain_communication` knows them).
GATHER_SCOPE = "gather_params"


def make_mesh(data: int = -1, fsdp: int = 1, devices: Any = None, *, tensor: int = 1) -> Mesh:
    """A ``("data", "fsdp", "tensor")`` mesh over ``devices`` (default: every device of every process).

    ``data=-1`` takes all the devices ``fsdp`` and ``tensor`` leave. The product must equal
    the device count. ``tensor`` is innermost (adjacent devices), and must divide each
    process's devices: its collectives stay inside a host.
    """
    devices = list(jax.devices() if devices is None else devices)
    count = len(devices)
    if fsdp < 1 or tensor < 1 or (data < 1 and data != -1):
        raise MeshError(f"mesh.data must be >= 1 or -1 (all devices), mesh.fsdp and mesh.tensor >= 1; got "
                        f"data={data}, fsdp={fsdp}, tensor={tensor}")
    if data == -1:
        if count % (fsdp * tensor):
            what = f"mesh.fsdp={fsdp}" if tensor == 1 else f"mesh.fsdp * mesh.tensor = {fsdp} * {tensor}"
            raise MeshError(f"{what} does not divide the {count} devices")
        data = count // (fsdp * tensor)
    if data * fsdp * tensor != count:
        product = (f"mesh.data * mesh.fsdp = {data} * {fsdp} = {data * fsdp}" if tensor == 1 else
                   f"mesh.data * mesh.fsdp * mesh.tensor = {data} * {fsdp} * {tensor} = {data * fsdp * tensor}")
        raise MeshError(f"{product}, but there are {count} devices ({_describe(devices)}); use mesh.data=-1 to "
                        f"take all of them, or set XLA_FLAGS=--xla_force_host_platform_device_count=N for N CPU "
                        f"devices")
    _check_tensor_in_hosts(devices, tensor)
    # Devices of one process stay adjacent along the data axis, so each process
    # feeds a contiguous block of the batch; tensor groups are adjacent ids in one process.
    ordered = sorted(devices, key=lambda d: (d.process_index, d.id))
    return Mesh(np.array(ordered, dtype=object).reshape(data, fsdp, tensor), AXES)


def _check_tensor_in_hosts(devices: list, tensor: int) -> None:
    """``tensor`` must divide every process's device count, so no tensor group spans two hosts."""
    per_process: dict[int, int] = {}
    for d in devices:
        per_process[d.process_index] = per_process.get(d.process_index, 0) + 1
    uneven = sorted(n for n in set(per_process.values()) if n % tensor)
    if uneven:
        raise MeshError(f"mesh.tensor={tensor} does not divide the {uneven[0]} devices of a process: a tensor group "
                        f"would span two hosts (its collectives need NVLink or ICI); use a mesh.tensor that divides "
                        f"{uneven[0]}")


def crossing_axes(mesh: Mesh) -> list[str]:
    """The mesh axes whose devices sit in more than one process (their collectives cross hosts)."""
    devices = mesh.devices
    crossing = []
    for i, axis in enumerate(mesh.axis_names):
        rows = np.moveaxis(devices, i, -1).reshape(-1, devices.shape[i])
        if any(len({d.process_index for d in row}) > 1 for row in rows):
            crossing.append(axis)
    return crossing


def _describe(devices: list) -> str:
    kinds = sorted({d.platform for d in devices})
    processes = len({d.process_index for d in devices})
    return f"{'/'.join(kinds)} over {processes} process{'es' if processes > 1 else ''}"


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where each array of a training run lives on ``mesh``.

    ``fsdp_min_size``: arrays with fewer elements stay replicated even when
    ``fsdp > 1`` (splitting a bias costs more in collectives than it saves).
    ``tensor_plan``: which dimension of each param the ``tensor`` axis splits
    (:mod:`train.parallel.tensor`; None: none, or not planned yet).
    ``sequence_parallel``: between the tensor-parallel blocks, activations are split along
    the sequence over ``tensor`` (Megatron-SP), not whole on each of its devices.
    ``tensor_reduce_dtype``: the dtype a row-parallel matmul's partial products (and a
    column-parallel one's input gradients) are summed across ``tensor`` in.
    ``rules``: ``sharding.rules``, ``((regex, (axis or None, ...)), ...)``: the layout of the
    params whose path matches, instead of the plan's (:func:`train.parallel.tensor.parse_rules`).
    """

    mesh: Mesh
    fsdp_min_size: int = 1024
    tensor_plan: TensorPlan | None = None
    sequence_parallel: bool = True
    tensor_reduce_dtype: str = "f32"
    rules: tuple = ()

    @property
    def data_shards(self) -> int:
        """How many ways a batch is split."""
        return self.mesh.devices.size // self.tensor

    @property
    def fsdp(self) -> int:
        return self.mesh.shape["fsdp"]

    @property
    def tensor(self) -> int:
        """Devices each tensor-parallel matmul is split over (1: none)."""
        return dict(self.mesh.shape).get("tensor", 1)

    @property
    def needs_plan(self) -> bool:
        """Params must be planned (:mod:`train.parallel.tensor`) before they are laid out."""
        return self.tensor_plan is None and (self.tensor > 1 or bool(self.rules))

    @property
    def splits_params(self) -> bool:
        """Some param is stored split (over ``fsdp`` or ``tensor``): the step gathers them."""
        return self.fsdp > 1 or self.tensor > 1 or bool(self.rules)

    def with_plan(self, plan: TensorPlan | None) -> "Layout":
        """This layout with ``plan`` splitting params over ``tensor``."""
        return dataclasses.replace(self, tensor_plan=plan)

    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, PartitionSpec())

    def batch(self) -> NamedSharding:
        """Leading (example) dimension split over the data axes (whole over ``tensor``)."""
        return NamedSharding(self.mesh, PartitionSpec(DATA_AXES))

    def param_spec(self, shape: tuple[int, ...], keys: tuple[str, ...] = ()) -> PartitionSpec:
        """The stored layout of an array of ``shape`` at path ``keys``: split over ``tensor``
        along the dimension the plan names for it (if any), and over ``fsdp`` along the last
        other dimension ``fsdp`` divides (the output features of Dense and Conv kernels), or
        replicated."""
        ruled = self.tensor_plan.spec(keys, tuple(shape)) if self.tensor_plan is not None and keys else None
        if ruled is not None:
            return PartitionSpec(*ruled)
        axes: list = [None] * len(shape)
        tensor_dim = self.tensor_dim(shape, keys)
        if tensor_dim is not None:
            axes[tensor_dim] = "tensor"
        if self.fsdp > 1 and int(np.prod(shape, dtype=np.int64)) >= self.fsdp_min_size:
            candidates = [i for i, n in enumerate(shape) if n % self.fsdp == 0 and i != tensor_dim]
            if candidates:
                axes[candidates[-1]] = "fsdp"
        while axes and axes[-1] is None:
            axes.pop()
        return PartitionSpec(*axes)

    def tensor_dim(self, shape: tuple[int, ...], keys: tuple[str, ...] = ()) -> int | None:
        """The dimension of the array at ``keys`` the ``tensor`` axis splits (None: whole)."""
        if self.tensor == 1 or self.tensor_plan is None or not keys:
            return None
        return self.tensor_plan.dim(keys, tuple(shape))

    def used_spec(self, shape: tuple[int, ...], keys: tuple[str, ...] = ()) -> PartitionSpec:
        """The layout a param is computed with: whole over ``fsdp``, still split over ``tensor``."""
        axes = [axis if axis == "tensor" else None for axis in self.param_spec(shape, keys)]
        while axes and axes[-1] is None:
            axes.pop()
        return PartitionSpec(*axes)

    def state(self, tree: Any) -> Any:
        """Shardings for every array of ``tree`` (a train state, params, optimizer state)."""
        return jax.tree_util.tree_map_with_path(
            lambda path, x: NamedSharding(self.mesh, self.param_spec(np.shape(x), key_names(path))), tree)

    def constrain_state(self, tree: Any) -> Any:
        """Inside ``jit``: pins ``tree``'s arrays to their layout."""
        return jax.lax.with_sharding_constraint(tree, self.state(tree))

    def gather(self, tree: Any, dtypes: Any = None) -> Any:
        """Inside ``jit``: the params of ``tree`` (a params tree) as the model computes with
        them: whole over ``fsdp`` (split over ``tensor`` where the plan says).

        Params are gathered where the model uses them, so the forward and
        backward passes compute exactly as under data parallelism (no
        half-precision partial sums across devices) and only the stored copies
        (params, float32 masters, optimizer moments) stay split.

        ``dtypes`` (a tree like ``tree``, from :func:`precision.read_dtypes`):
        each split array is cast to its dtype on its own shard, before the
        all-gather, so a param the model only reads in bfloat16 crosses the
        wire in bfloat16. An optimization barrier keeps XLA from moving the
        cast after the gather (jax#23543). Gradients come back in the stored
        layout (:mod:`train.parallel.gather`).
        """
        if not self.splits_params:
            return tree
        if dtypes is None:  # the params as the program reads them (traced for precision.read_dtypes)
            return jax.tree_util.tree_map_with_path(
                lambda path, x: jax.lax.with_sharding_constraint(
                    x, NamedSharding(self.mesh, self.used_spec(np.shape(x), key_names(path)))), tree)

        def one(path, x, dtype):
            keys, shape = key_names(path), np.shape(x)
            return gather_param(x, np.dtype(dtype), NamedSharding(self.mesh, self.used_spec(shape, keys)),
                                NamedSharding(self.mesh, self.param_spec(shape, keys)), self._order(keys, shape))

        with jax.named_scope(GATHER_SCOPE):
            return jax.tree_util.tree_map_with_path(one, tree, dtypes)

    def _order(self, keys: tuple[str, ...], shape: tuple[int, ...]) -> tuple | None:
        """A fused matmul's param: (interleave, undo) its parts over ``tensor`` (None: as stored)."""
        split = self.tensor_plan.split_of(keys, tuple(shape)) if self.tensor_plan is not None else None
        if split is None or split.parts == 1 or split.dim is None or self.tensor == 1:
            return None
        args = (split.dim, split.parts, self.tensor)
        return (lambda x: interleaved(x, *args)), (lambda g: deinterleaved(g, *args))

    def computing(self) -> Any:
        """Context for tracing the model: the mesh as JAX's abstract mesh, so a kernel that runs
        per device (the fused attention on a TPU, :mod:`precision.autocast.tpu_flash`) splits the
        batch over it as the data is split; under a tensor-parallel plan, the plan written into
        the model's program (:func:`train.parallel.tensor.tensor_pass`). One device: nothing."""
        stack = contextlib.ExitStack()
        if self.mesh.devices.size > 1:
            stack.enter_context(jax.sharding.use_abstract_mesh(self.mesh.abstract_mesh))
        if self.tensor > 1 and self.tensor_plan is not None:
            stack.enter_context(precision.program_pass(tensor_pass(self)))
        return stack

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
