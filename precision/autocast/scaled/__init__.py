"""Scaled matmuls: FP8 and int8 side by side.

Both are the same idea on the autocast path: an allow-listed matmul whose
operands are scaled into an 8-bit format, multiplied by the matrix unit with a
wide accumulator, and scaled back, with a backward of its own.

- FP8 (``compute=f8``): :mod:`.fp8_quantize` (E4M3/E5M2 power-of-two scales,
  amax histories), :mod:`.fp8_matmul` (tensorwise and rowwise products),
  :mod:`.fp8_sites` (which matmuls, their histories, what explain is told).
- int8 (``compute=int8``): :mod:`.int8_quantize` (absmax/127 scales per row or
  column, rounding to nearest or stochastically), :mod:`.int8_matmul` (the
  ``dot_general`` product and its backward), :mod:`.int8_conv` (convolutions,
  per output channel), :mod:`.int8_sites` (which matmuls, what explain is told).
- :mod:`.products`: what both share (the transposed products of a
  ``dot_general``, its M, K, N, scales laid out like its output).

The FP8 modules lived in :mod:`precision.autocast` before; their old import
paths (``precision.autocast.fp8_matmul``...) name the same modules.
"""
