"""The device mesh and layout a config asks for (the ``mesh``, ``sharding`` and ``precision``
sections), checked against the devices and the batch sizes before anything runs."""

from __future__ import annotations

from typing import Any

import jax

from train.config import ConfigError, ExperimentConfig
from train.parallel.distributed import Layout, MeshError, make_mesh

__all__ = ["describe_layout", "layout_of", "mesh_layout"]


def layout_of(config: ExperimentConfig, devices: Any = None) -> Layout:
    """The device mesh the config asks for, checked against the devices (default: every
    device of every process) and the batch sizes."""
    try:
        layout = mesh_layout(config, devices)
        layout.check_batch_size(config.data.eval_batch_size, "data.eval_batch_size")
    except MeshError as e:
        raise ConfigError(str(e)) from None
    return layout


def mesh_layout(config: ExperimentConfig, devices: Any = None) -> Layout:
    """The mesh and layout the ``mesh``, ``sharding`` and ``precision`` sections describe on
    ``devices``, checked against the training batch (:class:`MeshError` if it does not fit)."""
    mesh = config.mesh
    layout = Layout(make_mesh(mesh.data, mesh.fsdp, devices, tensor=mesh.tensor), mesh.fsdp_min_size,
                    sequence_parallel=mesh.sequence_parallel,
                    tensor_reduce_dtype=config.precision.tensor_reduce_dtype, rules=config.sharding.parsed())
    layout.check_batch_size(config.data.batch_size)
    return layout


def describe_layout(layout: Layout) -> str:
    """``8 cpu devices, mesh data=2 fsdp=4`` (and ``tensor=T`` when it splits layers), for the run's header."""
    shape = dict(layout.mesh.shape)
    devices = layout.mesh.devices.size
    processes = jax.process_count()
    where = f"{devices} {jax.devices()[0].platform} device{'s' if devices > 1 else ''}"
    if processes > 1:
        where += f" in {processes} processes"
    tensor = f" tensor={shape['tensor']}" if shape.get("tensor", 1) > 1 else ""
    return f"{where}, mesh data={shape['data']} fsdp={shape['fsdp']}{tensor}"
