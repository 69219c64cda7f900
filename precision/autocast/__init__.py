"""Autocast: the transformation that applies a policy's compute dtype to every op
of a traced program, whatever dtypes the model's layers pin.

How a call flows through it (``precision.autocast(fn, "mixed_bf16")(x)``, or a
module under :func:`precision.with_policy`):

1. :mod:`.tracing` traces ``fn`` (a model's call first transformed by the
   :func:`program_pass` in effect: how a layout splits it across devices) with every float16/bfloat16/float32 input seen
   as float32, so the program is the float32 one whatever the layers pin;
   ``jax.nn.dot_product_attention`` calls are marked on the way
   (:mod:`.fused_attention`). Module paths and compute-dtype regions ride on
   JAX's name stack (:mod:`.regions`).
2. :mod:`.interpreter` evaluates that program again, equation by equation,
   holding each value (:mod:`.values`) in the dtype the op lists
   (:mod:`.op_lists`: allow, deny, follow) and the float32 islands planned
   beforehand (:mod:`.islands`) give it; jit, scan, while, cond, remat,
   custom_jvp/vjp and shard_map are rewritten recursively (:mod:`.higher_order`),
   a marked attention is made again as cuDNN's on a GPU, ops whose derivative
   needs a deny-listed op get it in float32 (:mod:`.derivatives`), and, given a
   ``reduce_dtype``, the gradients of the params a half op reads are produced
   in it: the dtype data parallelism reduces them in (:mod:`.reductions`); a
   matmul a layout splits across devices makes its sums across them in the dtype
   its :func:`split_sums` scope names (:mod:`.split_sums`).
3. :mod:`.transform` is the entry point: outputs back in the dtypes ``fn``
   gives them, or as values that remember their kind (for the Flax adapters and
   :func:`precision.explain`).

:mod:`.program` reads a traced program back (every equation with its module
path, the FLOPs and operand dtypes of its matmuls), for ``explain`` and tests.

Import submodules as ``from precision.autocast import interpreter``:
``precision.autocast`` itself is the :func:`autocast` function.
"""

from precision.autocast.op_lists import ALLOW, DENY, OpClass, OpLists, op_lists
from precision.autocast.reductions import reduce_dtype_of
from precision.autocast.regions import compute_in
from precision.autocast.split_sums import split_sums
from precision.autocast.tracing import program_pass
from precision.autocast.transform import autocast, call, call_vals

__all__ = ["ALLOW", "DENY", "OpClass", "OpLists", "autocast", "call", "call_vals", "compute_in", "op_lists",
           "program_pass", "reduce_dtype_of", "split_sums"]

# The FP8 modules moved into .scaled (FP8 and int8 side by side): their old import paths
# (``from precision.autocast import fp8_matmul``) name the same modules.
import sys as _sys  # noqa: E402

from precision.autocast.scaled import fp8_matmul, fp8_quantize, fp8_sites  # noqa: E402,F401

for _name in ("fp8_matmul", "fp8_quantize", "fp8_sites"):
    _sys.modules.setdefault(f"{__name__}.{_name}", _sys.modules[f"{__name__}.scaled.{_name}"])
del _sys, _name
