"""The decode step compiled for a GPU this machine need not have, and its time against the bandwidth limit.

Decoding one token at batch 1 reads every weight and the whole cache once, for a few FLOPs
per byte: its time is bounded below by those bytes over the GPU's memory bandwidth. The
served step (:class:`train.serving.Generator`'s, sampling included) is compiled for the
target through JAX's compile-only CUDA client (:mod:`train.inspections.targets`), and its
kernels are modeled as ``--compile-for`` models a train step (:mod:`train.inspections.gpu_time`:
a model, not a measurement). :class:`DecodeStep` sets that modeled time beside the bytes a
token must read and their time at the datasheet's bandwidth (3.35 TB/s on an H100).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import SingleDeviceSharding

from train.inspections.gpu_kernels import read_kernels
from train.inspections.gpu_time import ModeledStep, datasheet, model_step
from train.inspections.targets import get_target, target_devices
from train.serving.sampling import Sampling
from train.serving.weights import tree_bytes

__all__ = ["DecodeStep", "compile_decode_step"]


class DecodeStep(NamedTuple):
    """One decode step compiled for ``target``: the bytes a token must read (``weight_bytes``: every
    weight, one row of a table only looked up; ``cache_bytes`` at ``length`` positions), the modeled step, the HLO's GEMMs by operand dtypes."""

    target: str
    batch: int
    length: int
    weight_bytes: int
    cache_bytes: int
    bandwidth: float
    modeled: ModeledStep
    gemms: dict[str, int]

    @property
    def bytes(self) -> int:
        return self.weight_bytes + self.cache_bytes

    @property
    def limit_seconds(self) -> float:
        """The bytes of a token over the datasheet's bandwidth: no step can be faster."""
        return self.bytes / self.bandwidth

    @property
    def ratio(self) -> float:
        return self.modeled.seconds / self.limit_seconds

    def line(self) -> str:
        return (f"decode step on {self.target} (batch {self.batch}, {self.length} positions; compile-only, modeled): "
                f"{self.modeled.seconds * 1e6:.1f} us per token against {self.limit_seconds * 1e6:.1f} us for its "
                f"{self.bytes / 1e6:.2f} MB at {self.bandwidth / 1e12:.2f} TB/s ({self.ratio:.2f}x); "
                f"{self.modeled.launches} kernel launches")


def compile_decode_step(generator: Any, target: str = "h100", batch: int = 1, length: int | None = None
                        ) -> DecodeStep:
    """Compiles ``generator``'s decode step (greedy) for ``target`` at ``batch`` rows and a cache of
    ``length`` positions (default: the model's context) and models it. Raises
    :class:`train.inspections.targets.TargetError` without JAX's CUDA plugin."""
    gpu = get_target(target)
    placed = SingleDeviceSharding(target_devices(gpu)[0])
    length = length or generator.source.context or 1024

    def abstract(tree):
        return jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=placed), tree)

    cache = jax.eval_shape(lambda: generator.decoder.init(batch, length))
    scalar = lambda dtype: jax.ShapeDtypeStruct((), dtype, sharding=placed)  # noqa: E731
    args = (abstract(generator.params), abstract(cache), jax.ShapeDtypeStruct((batch, 1), jnp.int32, sharding=placed),
            scalar(jnp.int32), scalar(jnp.uint32))
    # Pallas' Triton lowering (the fused kernels) asks the default device which GPU it is for (jax 0.11)
    device = target_devices(gpu)[0] if getattr(generator, "decode_kernels", "xla") == "fused" else None
    with jax.default_device(device):
        compiled = jax.jit(generator.run(Sampling(temperature=0)), donate_argnums=(1,)).lower(*args).compile()
    text = compiled.as_text()
    gemms: dict[str, int] = {}
    for kernel in read_kernels(text):
        if kernel.gemm:
            key = f"{kernel.kind} {' x '.join(kernel.operands)}"
            gemms[key] = gemms.get(key, 0) + 1
    return DecodeStep(gpu.name, batch, length, generator.served.token_bytes, tree_bytes(cache),
                      datasheet(gpu).bandwidth, model_step(text, gpu), gemms)
