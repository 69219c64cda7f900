"""Shared test settings: CPU, deterministic, fast.

Tests marked ``gpu`` need JAX's default backend to be a GPU (run them with
``JAX_PLATFORMS=cuda``); anywhere else they are skipped, with the reason.
"""

import os

import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from hypothesis import settings  # noqa: E402

settings.register_profile("ci", max_examples=200, deadline=None, derandomize=True)
settings.load_profile("ci")


def pytest_collection_modifyitems(config, items):
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu_items:
        return
    import jax  # only now: a session without gpu tests does not start a backend here

    backend = jax.default_backend()
    if backend == "gpu":
        return
    skip = pytest.mark.skip(reason=f"needs a GPU: JAX's default backend is {backend!r} "
                                   f"(run with JAX_PLATFORMS=cuda on a machine with one)")
    for item in gpu_items:
        item.add_marker(skip)
