"""Int8 matmuls: their options.

A policy with compute ``int8`` (preset ``mixed_int8``) runs every allow-listed
``dot_general`` and convolution at or above ``min_size`` with int8 operands
accumulated in int32 by the matrix unit (see
:mod:`precision.autocast.scaled.int8_matmul` for the arithmetic), and every
other op in the fallback dtype (bf16 unless ``compute=int8/f16``). The recipe
(AQT; SwitchBack and Jetfire; torchao's row-wise int8 training):

- scales per row of the activation and per column of the weight (per slice
  along the axes a product contracts), ``absmax / 127`` of that slice in this
  step (current scaling), values rounded to nearest: one outlier costs
  precision only to its own row; a convolution's per example and per output
  channel;
- ``backward="int8"`` (default): both backward products (the input's and the
  weight's gradient) in int8 too, each operand quantized again along the axes
  that product contracts; ``"bf16"``: both in the fallback dtype (SwitchBack
  keeps the weight gradient's in 16 bits);
- ``stochastic_rounding``: the output gradient rounded stochastically, with
  random bits drawn from a key folded from the gradient's own bits (the same
  gradient, the same bits: deterministic, and resumed bit for bit);
- ``min_size``: a matmul is int8 only when each of M, K and N is at least
  this (a convolution: its output pixels, window x input channels, output
  channels). The default, 128, is one tile of a TPU v5e's 128x128 matrix
  unit: a smaller product leaves the unit mostly idle in either dtype, and
  quantizing it costs more than it saves. ``0`` takes every matmul;
- ``attention``: False (default) keeps attention's batched products of two
  activations (q·kᵀ, probabilities·v) in the fallback dtype, as FP8 does;
- ``tpu_kernels``: True (default) runs each plain int8 matmul of a program lowered
  for one TPU in Pallas kernels that quantize in VMEM
  (:mod:`precision.autocast.scaled.int8_tpu`); False keeps XLA's recipe there too
  (the same forward values; the weight gradient quantized per whole column, not in
  tiles of 256 tokens). The kernels' speed is modeled, not measured: this is the
  switch to compare them, or to step around one on a TPU.

No state: int8 scales are current, so nothing is kept between steps, and a
checkpoint of a ``mixed_int8`` run is the same as a ``mixed_bf16`` one's.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal, Mapping

from precision.policy import PolicyError

__all__ = ["Int8Options", "int8_options", "as_int8_options", "DEFAULT_MIN_SIZE", "BACKWARDS"]

#: Matmuls with any of M, K, N below this stay in the fallback dtype (one 128x128 MXU tile).
DEFAULT_MIN_SIZE = 128
#: What the two backward products of an int8 matmul run in.
BACKWARDS = ("int8", "bf16")


@dataclasses.dataclass(frozen=True)
class Int8Options:
    """Which matmuls are int8 and how their backward runs (hashable: a static jit argument)."""

    backward: Literal["int8", "bf16"] = "int8"
    stochastic_rounding: bool = False
    min_size: int = DEFAULT_MIN_SIZE
    attention: bool = False
    tpu_kernels: bool = True

    @property
    def int8_backward(self) -> bool:
        return self.backward == "int8"


def int8_options(backward: str = "int8", stochastic_rounding: bool = False, min_size: int = DEFAULT_MIN_SIZE,
                 attention: bool = False, tpu_kernels: bool = True) -> Int8Options:
    """Options for int8 matmuls: the ``backward`` products in ``"int8"`` or ``"bf16"`` (the
    fallback dtype), ``stochastic_rounding`` of the output gradient, ``min_size``, whether
    ``attention``'s products may be int8, and whether one TPU runs them in the fused
    ``tpu_kernels`` (see :mod:`precision.int8`). Bad values raise
    :class:`precision.PolicyError` naming the valid ones."""
    if not isinstance(backward, str) or backward.strip().lower() not in BACKWARDS:
        raise PolicyError(f"int8 backward must be one of {', '.join(BACKWARDS)}, got {backward!r}")
    if isinstance(min_size, bool) or not isinstance(min_size, int) or min_size < 0:
        raise PolicyError(f"int8 min_size must be an integer >= 0, got {min_size!r}")
    for name, value in (("stochastic_rounding", stochastic_rounding), ("attention", attention),
                        ("tpu_kernels", tpu_kernels)):
        if not isinstance(value, bool):
            raise PolicyError(f"int8 {name} must be true or false, got {value!r}")
    return Int8Options(backward.strip().lower(), stochastic_rounding, min_size, attention,  # type: ignore[arg-type]
                       tpu_kernels)


def as_int8_options(value: "Int8Options | Mapping[str, Any] | None") -> Int8Options:
    """``int8=`` as the functions taking it accept it: options, a dict of their keys, or None (defaults)."""
    if value is None:
        return Int8Options()
    if isinstance(value, Int8Options):
        return value
    if isinstance(value, Mapping):
        fields = [f.name for f in dataclasses.fields(Int8Options)]
        unknown = set(value) - set(fields)
        if unknown:
            raise PolicyError(f"int8: unknown option(s) {sorted(unknown)}; valid: {', '.join(fields)}")
        return int8_options(**value)
    raise TypeError(f"int8 must be precision.int8_options(...), a dict of its keys or None, got {type(value).__name__}")
