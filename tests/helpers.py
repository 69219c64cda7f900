"""Helpers shared by the tests: checkpoints read off disk, subprocess environments."""

import os
from pathlib import Path

import jax
import numpy as np

ROOT = Path(__file__).resolve().parent.parent


def subprocess_env(**overrides: str) -> dict:
    """This process's environment plus ``overrides``, with the project root put
    in front of ``PYTHONPATH`` (whatever the user had there stays after it)."""
    env = dict(os.environ, **overrides)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return env


def saved_state(workdir, step=None):
    """``(step, tree)``: the arrays of the checkpoint at ``step`` (default: the
    newest) in ``WORKDIR/checkpoints``, read without a template onto this
    process's first device, whatever mesh or processes wrote them."""
    import orbax.checkpoint as ocp

    from train import Checkpointer

    if step is None:
        ckpt = Checkpointer(os.path.join(workdir, "checkpoints"))
        step = ckpt.latest_step()
        ckpt.close()
    path = os.path.join(workdir, "checkpoints", str(step), "state")
    with ocp.StandardCheckpointer() as c:
        meta = c.metadata(path)
        meta = getattr(meta, "item_metadata", meta)
        meta = getattr(meta, "tree", meta)
        device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        target = jax.tree_util.tree_map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=device), meta)
        return step, c.restore(path, target)


def saved_leaves(workdir, step=None):
    """``(step, leaves)`` of a checkpoint, see :func:`saved_state`."""
    step, tree = saved_state(workdir, step)
    return step, jax.tree_util.tree_leaves(tree)


def assert_bitwise_equal(a, b):
    """Same number of arrays, same dtypes, same bytes."""
    assert len(a) == len(b)
    for x, y in zip(a, b):
        x, y = np.asarray(x), np.asarray(y)
        assert x.dtype == y.dtype
        np.testing.assert_array_equal(x.reshape(-1).view(np.uint8), y.reshape(-1).view(np.uint8))
