"""A persistent XLA compilation cache for ``python -m train`` and the benchmarks.

A second run of an experiment (a resumed one, or ``python -m benchmarks``
again) loads the programs it compiled before instead of compiling them again
(a GPT-2-small step takes about 50 s to compile on a GPU), and programs that
repeat within a run are compiled once. On a GPU the cache also keeps XLA's
autotuning results.

Where it lives, first match wins: the ``compile_cache`` config field or
``--cache-dir DIR`` of the benchmarks; the ``MP_COMPILE_CACHE_DIR`` environment
variable; JAX's own ``JAX_COMPILATION_CACHE_DIR``;
``$XDG_CACHE_HOME/flax-mixed-precision/jax`` (``~/.cache/...``).
``compile_cache=null``, ``--no-cache`` or ``MP_COMPILE_CACHE_DIR=off`` turns it off.
"""

from __future__ import annotations

import os
import pathlib

import jax

ENV = "MP_COMPILE_CACHE_DIR"
_OFF = ("", "0", "off", "none", "false", "no")


def default_dir() -> pathlib.Path | None:
    """The cache directory from the environment (None: turned off)."""
    env = os.environ.get(ENV)
    if env is not None:
        return None if env.strip().lower() in _OFF else pathlib.Path(env).expanduser()
    jax_dir = os.environ.get("JAX_COMPILATION_CACHE_DIR")
    if jax_dir:
        return pathlib.Path(jax_dir).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache"
    return pathlib.Path(base) / "flax-mixed-precision" / "jax"


def enable(directory: str | os.PathLike | None = None) -> pathlib.Path | None:
    """Points JAX's persistent compilation cache at ``directory`` (default
    :func:`default_dir`) and caches every program, however fast it compiled.

    Call it before the first compilation. Returns the directory, or None when
    the cache is off.
    """
    path = default_dir() if directory is None else pathlib.Path(directory).expanduser()
    if path is None:
        return None
    path.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return path
