"""A fused projection split after its matmul, computed as one matmul per part on a TPU.

Many models compute a layer's query, key and value with one matmul and split its
result (nanoGPT's ``c_attn``, Hugging Face's GPT-2, this project's GPT)::

    qkv = x @ w + b                                   # (batch, T, 3 * heads * head size)
    q, k, v = split(qkv.reshape(batch, T, 3 * heads, head size), 3, axis=2)

On a TPU the attention kernel reads each of ``q``, ``k`` and ``v`` heads-first
(``(batch, heads, T, head size)``), and XLA cannot lay the one matmul's result out so
that its three slices are: it copies the whole result twice forward and twice
backward. Three matmuls, ``x @ w[:, part]``, each written heads-first, need none of it:
XLA's layout of a ``DenseGeneral`` to ``(heads, head size)``. Modeled on a v5e (GPT-2
small, 16 x 1024 tokens), a layer's attention takes 6.9 ms -> 4.7 ms in ``mixed_bf16``
(``docs/fused-attention.md``).

:func:`plan` finds the pattern: a ``dot_general`` contracting its input's last axis with
a 2-D weight's first, an optional bias (shaped ``(1, ..., 1, N)``) added, its result
reshaped to ``(..., parts, size)`` and split along ``parts`` (or split along its last
axis as it is, each part then reshaped to ``(..., heads, head size)``), every value between
used once. :func:`emit` makes the split's results
under ``jax.lax.platform_dependent``: on a TPU, each part's own product (``x`` by the
weight's columns of that part, the bias's too, each product decided as the whole one
is: its dtype, int8...); everywhere else, the equations as written (the same program as
without this, its decisions logged). Values are the same either way: each output is
the same dot product. Left as written (:func:`applies`): a small product, FP8 products, a
weight read from codes, a program split over devices, and
``precision.op_lists(split_projections=False)``.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections import Counter
from typing import Any, Callable

import jax
from jax.extend.core import Literal

from precision.autocast.values import Val, literal_val

__all__ = ["Split", "plan", "applies", "emit", "parts_of"]

#: How the lowering picks a branch (a name tests replace to run the TPU branch on a CPU).
platform_dependent = jax.lax.platform_dependent


@dataclasses.dataclass(frozen=True)
class Split:
    """A fused projection: its equations (``dot``, ``add`` or None, ``reshape`` or None, ``split``,
    each part's own ``reshapes``, as indices), the input, weight and bias vars, each part's columns of
    the weight, and the vars the parts end in (``(..., heads, head size)`` each, or as split)."""

    dot: int
    add: int | None
    reshape: int | None
    split: int
    x: Any
    w: Any
    bias: Any
    columns: tuple[tuple[int, int], ...]
    outs: tuple
    reshapes: tuple[int, ...] = ()
    scales: tuple = ()  # per part: (the index of the ``mul`` by a scalar its result is read by, the scalar), or None

    @property
    def eqns(self) -> set[int]:
        scaled = (s[0] for s in self.scales if s is not None)
        return {i for i in (self.dot, self.add, self.reshape, self.split, *self.reshapes, *scaled) if i is not None}


def plan(jaxpr: Any, taken: set[int], enabled: bool = True) -> dict[int, Split]:
    """The fused projections of ``jaxpr`` to split, by the index of their ``split`` equation
    (none of their equations among ``taken``: those of other fusions)."""
    if not enabled or not any(e.primitive.name == "split" for e in jaxpr.eqns):
        return {}
    uses = Counter(v for e in jaxpr.eqns for v in e.invars if not isinstance(v, Literal))
    uses.update(v for v in jaxpr.outvars if not isinstance(v, Literal))
    made = {v: i for i, e in enumerate(jaxpr.eqns) for v in e.outvars}
    read_by = {v: i for i, e in enumerate(jaxpr.eqns) for v in e.invars if not isinstance(v, Literal)}
    found = {}
    for i, eqn in enumerate(jaxpr.eqns):
        if eqn.primitive.name == "split":
            split = _match(jaxpr, i, made, uses, read_by)
            if split is not None and not split.eqns & taken:
                found[i] = split
    return found


def _match(jaxpr: Any, index: int, made: dict, uses: Counter, read_by: dict) -> Split | None:
    """The pattern ending at the ``split`` equation ``index``, or None."""
    eqns = jaxpr.eqns
    split = eqns[index]
    value = split.invars[0]
    reshape = _single_producer(eqns, value, made, uses, "reshape")
    if reshape is not None:
        value = eqns[reshape].invars[0]
    add = _single_producer(eqns, value, made, uses, "add")
    bias = None
    if add is not None:
        a, b = eqns[add].invars
        value, bias = (a, b) if _producer(eqns, a, made) == "dot_general" else (b, a)
        if isinstance(bias, Literal) or isinstance(value, Literal):
            return None
    dot = _single_producer(eqns, value, made, uses, "dot_general")
    if dot is None:
        return None
    x, w = eqns[dot].invars
    out = eqns[dot].outvars[0].aval
    (x_contract, w_contract), batch = eqns[dot].params["dimension_numbers"]
    if (tuple(x_contract) != (x.aval.ndim - 1,) or tuple(w_contract) != (0,) or any(batch) or w.aval.ndim != 2
            or eqns[dot].params.get("out_sharding") is not None):
        return None
    n = w.aval.shape[1]
    if bias is not None and tuple(bias.aval.shape) != (1,) * (out.ndim - 1) + (n,):
        return None
    columns = parts_of(split.params["sizes"], split.params["axis"], out.shape, split.invars[0].aval.shape)
    if columns is None:
        return None
    if reshape is not None:
        return _scaled(eqns, Split(dot, add, reshape, index, x, w, bias, columns, tuple(split.outvars)), uses, read_by)
    reshapes = _heads_of(eqns, split.outvars, uses, read_by)  # split as it is: each part made (heads, head size)
    if reshapes is None:
        return None
    outs = tuple(eqns[i].outvars[0] for i in reshapes)
    return _scaled(eqns, Split(dot, add, None, index, x, w, bias, columns, outs, reshapes), uses, read_by)


def _scaled(eqns: list, split: Split, uses: Counter, read_by: dict) -> Split:
    """``split`` with each part read once, by a ``mul`` by a scalar literal (a query scaled by ``head size
    ** -0.5`` before its attention), taking that ``mul`` in: the part then ends in its result."""
    scales, outs = [], []
    for var in split.outs:
        i = read_by.get(var)
        mul = eqns[i] if i is not None and uses[var] == 1 else None
        scalar = None if mul is None or mul.primitive.name != "mul" else next(
            (v for v in mul.invars if isinstance(v, Literal) and v.aval.shape == ()), None)
        scales.append(None if scalar is None else (i, scalar))
        outs.append(var if scalar is None else mul.outvars[0])
    return dataclasses.replace(split, outs=tuple(outs), scales=tuple(scales)) if any(scales) else split


def _heads_of(eqns: list, parts: list, uses: Counter, read_by: dict) -> tuple[int, ...] | None:
    """The reshape each part is read by, giving it ``(..., heads, head size)`` from its last axis
    (Hugging Face's GPT-2 splits its ``c_attn`` so, then each part into heads); None where a part
    is read otherwise (made as one 2-D product each, the parts would gain nothing)."""
    found = []
    for var in parts:
        i = read_by.get(var)
        if i is None or uses[var] != 1 or eqns[i].primitive.name != "reshape" or eqns[i].params.get("dimensions"):
            return None
        shape, new = tuple(var.aval.shape), tuple(eqns[i].outvars[0].aval.shape)
        if len(new) != len(shape) + 1 or new[:-2] != shape[:-1] or new[-2] * new[-1] != shape[-1]:
            return None
        found.append(i)
    return tuple(found)


def parts_of(sizes: Any, axis: int, out_shape: tuple, split_shape: tuple) -> tuple[tuple[int, int], ...] | None:
    """Each part's columns of the product's last axis (``out_shape``) for a split of ``sizes`` along
    ``axis`` of ``split_shape`` (the product, or it reshaped to ``(..., parts, size)``), or None where
    a part is not a block of whole columns."""
    lead = tuple(out_shape[:-1])
    if tuple(split_shape) == tuple(out_shape) and axis == len(out_shape) - 1:
        width = 1
    elif tuple(split_shape[:-2]) == lead and axis == len(split_shape) - 2 and len(split_shape) == len(out_shape) + 1:
        width = split_shape[-1]
    else:
        return None
    columns, start = [], 0
    for size in sizes:
        columns.append((start, start + int(size) * width))
        start += int(size) * width
    return tuple(columns) if start == out_shape[-1] and len(columns) > 1 else None


def _producer(eqns: list, var: Any, made: dict) -> str | None:
    return None if isinstance(var, Literal) or var not in made else eqns[made[var]].primitive.name


def _single_producer(eqns: list, var: Any, made: dict, uses: Counter, name: str) -> int | None:
    """The index of the ``name`` equation making ``var``, where ``var`` is read once (by the pattern)."""
    if _producer(eqns, var, made) != name or uses[var] != 1:
        return None
    return made[var]


#: Made part by part from this many elements of the product, and this many of its rows per input
#: (tokens over the size each contracts): below either, the matmuls and weight slices it adds cost more
#: than the copies it saves. Modeled on a v5e, mixed_bf16: GPT-2 small (2 layers) +2.7% at 2 x 1024
#: tokens (4.5 Mi elements), +0.5% at 4 x 1024 (9 Mi, 5 rows per input), -2.8% at 8 x 1024 (18 Mi,
#: 11 rows), -14.0% at 16 x 1024 (12 layers); a GPT 256 wide +1.7% at 8 x 256 tokens (1.5 Mi), -1.1%
#: at 64 x 256 (12 Mi); d_model 2048 at 8 x 2048 tokens (8 rows) -6.3% (2 layers); d_model 4096 at
#: 2 x 2048 (1 row) +0.9 ms a layer.
MIN_ELEMENTS, MIN_ROWS_PER_INPUT = 10 * 2**20, 8


def applies(split: Split, env: dict, fp8: bool) -> bool:
    """Whether ``split`` is made part by part on a TPU: a product large enough (:data:`MIN_ELEMENTS`,
    :data:`MIN_ROWS_PER_INPUT`), not in FP8 (``fp8``: its product's site is in an FP8 region, and an
    FP8 product's scaling state is one per product), its weight not read from codes, the program not
    split over devices (a mesh in context, as :mod:`.tpu_flash` reads it: a sharded weight's columns
    would move between them)."""
    mesh = jax.sharding.get_abstract_mesh()
    x, w = env[split.x].array, env[split.w].array
    rows = math.prod(x.shape[:-1])
    return (rows * w.shape[1] >= MIN_ELEMENTS and rows >= MIN_ROWS_PER_INPUT * x.shape[-1] and not fp8
            and env[split.w].source is None and (mesh is None or mesh.empty or mesh.size == 1))


def emit(jaxpr: Any, split: Split, env: dict, as_written: Callable[[Any], list], rewritten: Callable, log: Any,
         int8: bool = False, bias_in_product: bool = False) -> dict | None:
    """``{var: Val}``, the split's results: on a TPU each part's own product, everywhere else
    ``as_written(log)`` (the pattern's equations rewritten one by one into ``log``, its Vals).
    ``rewritten(index, ins, bias=None)``: equation ``index`` of the pattern rewritten on other
    operands, its decisions unlogged: (its Val, whether its product added ``bias`` itself);
    ``int8``: its products are int8; ``bias_in_product``: the bias is handed to each part's product
    (an int8 kernel adds it before rounding its result: no pass of its own). None where the two
    branches do not agree (their dtypes): the caller then runs the equations as written."""
    outs = split.outs
    x, w = env[split.x], env[split.w]
    lead = x.array.ndim - 1
    written: list = []  # the Vals each branch made, by platform: which branches are traced is JAX's choice
    made: list = []
    records: list | None = None if log is None else []

    def per_part(x: Val, columns: tuple[int, int], var: Any, scale: tuple | None) -> Any:
        tail = tuple(var.aval.shape[lead:])  # (heads, head size), or (columns,) for a split as it is
        # an int8 product's scalar factor taken into its weight and bias (weight-sized passes): x . (c w) + c b
        folded = scale is not None and int8
        c = float(scale[1].val) if folded else 1.0
        weight = w.moved(w.array[:, columns[0]:columns[1]].reshape(w.array.shape[0], *tail) * c)
        bias = None
        if split.add is not None:
            bias = env[split.bias]
            bias = bias.moved(bias.array[..., columns[0]:columns[1]].reshape((1,) * lead + tail) * c)
        part, added = rewritten(split.dot, [x, weight], bias if bias_in_product else None)
        if bias is not None and not added:
            ins = [part, bias] if jaxpr.eqns[split.add].invars[0] is not split.bias else [bias, part]
            part, _ = rewritten(split.add, ins)
        if scale is not None and not folded:  # as written, after the product
            mul = jaxpr.eqns[scale[0]]
            part, _ = rewritten(scale[0], [literal_val(v) if isinstance(v, Literal) else part for v in mul.invars])
        made.append(part)
        return part.array

    def tpu() -> list:
        # x cast once for every part; for int8 products once for each (modeled on a v5e, GPT-2 small:
        # bf16 188.0 -> 185.5 ms with one cast, int8 234.4 -> 236.4: XLA then fuses it less well)
        here = None if int8 else x.apart()
        scales = split.scales or (None,) * len(outs)
        return [per_part(here or x.apart(), c, v, s) for c, v, s in zip(split.columns, outs, scales)]

    def default() -> list:
        written[:] = as_written(records)
        return [v.array for v in written]

    try:
        arrays = platform_dependent(tpu=tpu, default=default)
    except TypeError as e:  # the branches disagree (their dtypes): an optimisation never fails a model
        warnings.warn(f"autocast: a fused projection made part by part for a TPU differs from it as written "
                      f"({e}); it runs as written. Please report this.", RuntimeWarning, stacklevel=2)
        return None
    if records:
        log.extend(records)
    written = written or made
    return {var: Val(val.kind, array, val.path) for var, val, array in zip(outs, written, arrays)}
