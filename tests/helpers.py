"""Helpers shared by the tests: checkpoints read off disk, subprocess environments."""

import functools
import gzip
import os
import sys
from pathlib import Path

import jax
import numpy as np

ROOT = Path(__file__).resolve().parent.parent


def subprocess_env(**overrides: str) -> dict:
    """This process's environment plus ``overrides``, with the project root put
    in front of ``PYTHONPATH`` (whatever the user had there stays after it) and
    ``XLA_FLAGS`` given added to this session's."""
    env = dict(os.environ, **overrides)
    if "XLA_FLAGS" in overrides and os.environ.get("XLA_FLAGS"):  # added to this session's flags, not instead
        env["XLA_FLAGS"] = f"{os.environ['XLA_FLAGS']} {overrides['XLA_FLAGS']}"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return env


def interruptible(module: str, *args: str) -> list[str]:
    """The command line of ``python -m module args`` in which Ctrl-C (SIGINT) raises
    ``KeyboardInterrupt`` whatever this process inherited (a test runner started as a
    background job or under ``nohup`` has it ignored, and a child would keep it ignored):
    the child sets Python's own handler before the module runs (not a ``preexec_fn``,
    unsafe in a process with threads, as JAX's)."""
    code = ("import runpy, signal; signal.signal(signal.SIGINT, signal.default_int_handler); "
            f"runpy.run_module({module!r}, run_name='__main__', alter_sys=True)")
    return [sys.executable, "-c", code, *args]


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


def tiny_fashion_mnist(directory: Path) -> Path:
    """Random Fashion-MNIST-shaped idx files (256 train, 128 test) in ``directory``, for configs that read it."""
    rng = np.random.default_rng(0)
    for stem, shape in (("train-images-idx3-ubyte", (256, 28, 28)), ("train-labels-idx1-ubyte", (256,)),
                        ("t10k-images-idx3-ubyte", (128, 28, 28)), ("t10k-labels-idx1-ubyte", (128,))):
        values = rng.integers(0, 10 if len(shape) == 1 else 256, shape, dtype=np.uint8)
        header = bytes([0, 0, 8, len(shape)]) + b"".join(n.to_bytes(4, "big") for n in shape)
        with gzip.open(directory / f"{stem}.gz", "wb") as f:
            f.write(header + values.tobytes())
    return directory


#: A short text for configs that read Shakespeare.
TINY_TEXT = ("To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer the slings and "
             "arrows of outrageous fortune, or to take arms against a sea of troubles.\n") * 120


def all_eqns(jaxpr):
    """Every equation of ``jaxpr`` and of the programs inside it (scan, cond, custom_vjp, pjit...)."""
    for eqn in jaxpr.eqns:
        yield eqn
        for value in eqn.params.values():
            for inner in value if isinstance(value, (tuple, list)) else (value,):
                inner = getattr(inner, "jaxpr", inner)
                if hasattr(inner, "eqns"):
                    yield from all_eqns(inner)


def pallas_calls(jaxpr, name=""):
    """The Pallas calls of ``jaxpr`` (sub-programs included) whose kernel's name holds ``name``."""
    return [e for e in all_eqns(jaxpr) if e.primitive.name == "pallas_call" and name in str(e.params["name"])]


def flax_transformers():
    """``transformers`` with its Flax models (versions before 5), or the calling test skipped
    saying why: the Hugging Face tests need ``FlaxGPT2LMHeadModel``."""
    import pytest

    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "FlaxGPT2LMHeadModel"):
        pytest.skip(f"transformers {transformers.__version__} has no Flax models (version 5 dropped them)")
    return transformers


@functools.lru_cache(maxsize=None)
def h100_device():
    """One compile-only H100 device of JAX's CUDA plugin (no GPU needed), or None where the
    plugin is not installed."""
    from train.inspections.targets import TargetError, get_target, target_devices

    try:
        return target_devices(get_target("h100"))[0]
    except TargetError:
        return None


def needs_cuda_plugin():
    """Skips the calling test, saying why, where JAX's CUDA plugin is not installed."""
    import pytest

    if h100_device() is None:
        pytest.skip("needs JAX's CUDA plugin (no GPU): pip install '.[gpu-compile]'")


@functools.lru_cache(maxsize=None)
def has_libtpu() -> bool:
    """Whether libtpu is installed here (compiling for a TPU slice needs it, not a TPU)."""
    from train.inspections.targets import TargetError, get_target, target_devices

    try:
        target_devices(get_target("v5e"))
    except TargetError:
        return False
    return True


def needs_libtpu():
    """Skips the calling test, saying why, where libtpu is not installed."""
    import pytest

    if not has_libtpu():
        pytest.skip("needs libtpu (no TPU): pip install '.[tpu-compile]'")
