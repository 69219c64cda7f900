"""Helpers shared by the tests that read checkpoints off disk."""

import os

import jax
import numpy as np


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
