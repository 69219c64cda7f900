"""The loss computed a block of rows at a time: :func:`blockwise_loss` and :func:`plan`.

A function (a train step's forward and loss) is traced; where its program computes a
loss from logits of at least ``min_logits_bytes`` (:mod:`.region`), that part runs as a
``lax.scan`` over blocks of rows, each block's logits made, read and dropped, the
block's function under ``jax.checkpoint`` so the backward pass makes each block's
logits again instead of keeping them. The rest of the program runs as traced. Rows are
independent in the region (proved op by op), so the result is the same computation: the
same ops on fewer rows. A weight is cast to the compute dtype once, outside the loop, and
its gradient reaches the float32 master summed over blocks in float32 (:func:`_cast_like`).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Literal

from precision.autocast.regions import module_path, scope_names
from precision.blockwise.program import Op, Program, bind_as_traced, flatten, inline_custom_jvp, read, run
from precision.autocast import reductions
from precision.blockwise.region import Region, find_region, why_not
from precision.blockwise.rows import is_cross_entropy, reduced_op
from precision.losses import cross_entropy_core

__all__ = ["Plan", "blockwise_loss", "plan", "min_logits_bytes", "AUTO_MIN_LOGITS_BYTES", "MIN_LOGITS_BYTES",
           "BLOCK_BYTES"]

#: Logits (counted in float32) from which :func:`blockwise_loss` computes the loss in blocks:
#: below, a program's logits cost less memory than the blocks' overhead is worth.
MIN_LOGITS_BYTES = 256 * 2**20
#: The same, for a train step left to decide (``blockwise_loss="auto"``): from 8 GiB of float32
#: logits, a tenth of an 80 GB GPU (GPT-2's vocabulary at 42 x 1024 tokens, Llama-3's at 17 x
#: 1024), their memory (and their gradient's) limits the batch; below, the whole logits are the
#: faster step (the blocks cost one more pass of the head's matmul: docs/blockwise-loss.md).
AUTO_MIN_LOGITS_BYTES = 8 * 2**30
#: The float32 bytes of one block's logits the blocks are sized to (at most); blocks also hold
#: at most a quarter of the whole logits (:func:`block_budget`), so that logits from
#: :data:`MIN_LOGITS_BYTES` up to four times this are computed in blocks too.
BLOCK_BYTES = 2**30
#: The fewest blocks the default budget splits the logits into (where the rows allow).
MIN_BLOCKS = 4


class Plan(NamedTuple):
    """What :func:`blockwise_loss` does to a program (for explain and ``--compile-for``)."""

    found: bool
    reason: str  # why not, when not found
    head: str = ""  # the module path of the logits' matmul
    logits: tuple = ()  # shape of the whole logits
    logits_dtype: str = ""
    rows: int = 0
    block_rows: int = 0
    blocks: int = 0
    whole_bytes: int = 0  # the region's logits-sized values, whole
    block_bytes: int = 0  # the same, one block

    def describe(self) -> str:
        """One line for people."""
        if not self.found:
            return f"Blockwise loss: not applied ({self.reason})"
        return (f"Blockwise loss: {self.head or 'the head'} logits {list(self.logits)} {self.logits_dtype} in "
                f"{self.blocks} blocks of {self.block_rows} rows (logits-sized values {_gib(self.whole_bytes)} whole, "
                f"{_gib(self.block_bytes)} a block)")


def blockwise_loss(fn: Callable, *, min_logits_bytes: int | None = None, block_bytes: int | None = None,
                   row_multiple: int = 1) -> Callable:
    """``fn`` with the loss it computes from large logits computed a block of rows at a time
    (the same result; no whole-logits value in either pass). ``min_logits_bytes`` defaults
    to :data:`MIN_LOGITS_BYTES`; ``block_bytes`` (a block's float32 logits, at most) to
    :func:`block_budget`'s, 1 GiB and a quarter of the whole logits; ``row_multiple``: a
    block's rows are a multiple of it (the devices the rows are split
    over, so that no block crosses them). A program without such a loss runs as written."""

    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        leaves, tree = jax.tree_util.tree_flatten((args, kwargs))

        def flat(*xs: Any) -> Any:
            a, k = jax.tree_util.tree_unflatten(tree, xs)
            return fn(*a, **k)

        closed, out_shape = jax.make_jaxpr(flat, return_shape=True)(*leaves)
        program, region = _program_and_region(closed, _or(min_logits_bytes, MIN_LOGITS_BYTES))
        k = region and block_rows(region, program, block_budget(region, program, block_bytes), row_multiple)
        if region is None or k >= region.rows:
            return fn(*args, **kwargs)  # as written, traced again: nothing of this analysis stays
        outputs = _evaluate(program, region, leaves, k)
        return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(out_shape), outputs)

    return wrapped


def min_logits_bytes(mode: str) -> int | None:
    """The threshold of a mode of ``precision.op_lists(blockwise_loss=)``: ``"auto"``
    :data:`AUTO_MIN_LOGITS_BYTES`, ``"on"`` :data:`MIN_LOGITS_BYTES`, ``"off"`` None (never)."""
    return {"auto": AUTO_MIN_LOGITS_BYTES, "on": MIN_LOGITS_BYTES}.get(mode)


def _or(value: int | None, default: int) -> int:
    return default if value is None else value


def plan(fn: Callable, *args: Any, min_logits_bytes: int | None = None, block_bytes: int | None = None,
         row_multiple: int = 1, **kwargs: Any) -> Plan:
    """What :func:`blockwise_loss` would do to ``fn(*args, **kwargs)`` (traced abstractly)."""
    min_logits_bytes = _or(min_logits_bytes, MIN_LOGITS_BYTES)
    closed = jax.make_jaxpr(lambda a, k: fn(*a, **k))(args, kwargs)
    program, region = _program_and_region(closed, min_logits_bytes)
    if region is None:
        return Plan(False, why_not(program, min_logits_bytes))
    budget = block_budget(region, program, block_bytes)
    k = block_rows(region, program, budget, row_multiple)
    head = program.ops[region.head]
    logits = program.avals[head.outs[0]]
    if k >= region.rows:
        return Plan(False, _one_block(region.rows, budget, row_multiple))
    path = "/".join(module_path(scope_names(head.eqn.source_info.name_stack)))
    return Plan(True, "", path, tuple(logits.shape), np.dtype(logits.dtype).name, region.rows, k,
                region.rows // k, region.big_bytes, region.big_bytes * k // region.rows)


def block_budget(region: Region, program: Program, block_bytes: int | None = None) -> int:
    """The float32 logits bytes a block may hold: ``block_bytes`` where given, else
    :data:`BLOCK_BYTES` and at most the whole logits over :data:`MIN_BLOCKS` (logits of
    256 MiB to 4 GiB, which one 1 GiB block would hold, still go in blocks)."""
    if block_bytes is not None:
        return block_bytes
    logits = program.avals[program.ops[region.head].outs[0]]
    return min(BLOCK_BYTES, int(np.prod(logits.shape)) * 4 // MIN_BLOCKS)


def _one_block(rows: int, budget: int, row_multiple: int) -> str:
    """Why a region's rows make one block."""
    if rows == 1:
        return "the logits have one row (a block is rows of the batch; one sequence is not split)"
    if not any(rows % k == 0 and k % row_multiple == 0 for k in range(1, rows)):
        return f"its {rows} rows, split over {row_multiple} devices, make no smaller block"
    return f"one block of {rows} rows already fits {_gib(budget)}"


def block_rows(region: Region, program: Program, block_bytes: int, row_multiple: int = 1) -> int:
    """Rows a block takes: the most that divide the rows, are a multiple of ``row_multiple``
    and keep a block's float32 logits within ``block_bytes`` (at least ``row_multiple``)."""
    logits = program.avals[program.ops[region.head].outs[0]]
    per_row = int(np.prod(logits.shape[1:])) * 4
    n = region.rows
    fits = [k for k in range(1, n + 1) if n % k == 0 and k % row_multiple == 0]
    if not fits:
        return n
    within = [k for k in fits if k * per_row <= block_bytes]
    return max(within) if within else min(fits)


def _program_and_region(closed: Any, min_logits_bytes: int) -> tuple[Program, Region | None]:
    program = flatten(closed)
    region = find_region(program, min_logits_bytes)
    custom_jvp = [i for i in (region.ops if region else ()) if program.ops[i].name == "custom_jvp_call"]
    if custom_jvp:  # see inside them (jax.nn.softmax, logsumexp): their primal computation, then again
        program = inline_custom_jvp(program, custom_jvp)
        region = find_region(program, min_logits_bytes)
    return program, region


def _evaluate(program: Program, region: Region, leaves: list, k: int) -> list:
    """The program's outputs, the region computed in blocks of ``k`` rows."""
    before, after = _split_outside(program, set(region.ops))
    env = dict(zip(program.inputs, leaves)) | dict(program.consts)
    run([program.ops[i] for i in before], env)
    env.update(zip(region.outputs, _blocks(program, region, env, k)))
    run([program.ops[i] for i in after], env)
    return [read(env, x) for x in program.outputs]


def _split_outside(program: Program, inside: set[int]) -> tuple[list[int], list[int]]:
    """Ops outside the region: those it may read (none of them reads it), then the others."""
    touched: set[int] = set()  # values that depend on the region
    before, after = [], []
    for i, op in enumerate(program.ops):
        if i in inside:
            touched.update(op.outs)
            continue
        if any(not isinstance(x, Literal) and x in touched for x in op.ins):
            touched.update(op.outs)
            after.append(i)
        else:
            before.append(i)
    return before, after


def _blocks(program: Program, region: Region, env: dict, k: int) -> list:
    """The region's outputs, computed by a scan over blocks of ``k`` rows (interleaved:
    block j holds rows j, j + blocks, ..., so rows split over devices stay on them). A value
    of row factor f (:func:`precision.blockwise.rows.row_factors`) takes f entries a row."""
    n, blocks = region.rows, region.rows // k
    factors = region.rows_of
    # a weight's cast is read as made, once, its gradient sent to the master (summed over blocks in float32)
    invariants = [(_arranged(program, *region.cast_from[x], env), jax.lax.stop_gradient(env[x]))
                  if x in region.cast_from else env[x] for x in region.invariant_inputs]
    ops = [program.ops[i] for i in region.ops]

    def one_block(invariant: list, rows: list) -> list:
        local = {x: _cast_like(*v) if x in region.cast_from else v
                 for x, v in zip(region.invariant_inputs, invariant)}
        local.update((x, r.reshape(k * factors[x], *r.shape[2:])) for x, r in zip(region.row_inputs, rows))
        run(ops, local, functools.partial(_bind_block, rows_of=factors, n=n, k=k))
        return [local[x] for x in region.outputs]

    one_block = jax.checkpoint(one_block, policy=_keep_reductions)
    split = [jnp.moveaxis(env[x].reshape(k, blocks, factors[x], *env[x].shape[1:]), 1, 0)
             for x in region.row_inputs]
    _, stacked = jax.lax.scan(lambda carry, rows: (carry, one_block(invariants, rows)), None, split)
    return [jnp.moveaxis(y.reshape(blocks, k, factors[x], *y.shape[2:]), 0, 1).reshape(n * factors[x], *y.shape[2:])
            for x, y in zip(region.outputs, stacked)]


def _arranged(program: Program, master: int, chain: tuple, env: dict) -> jax.Array:
    """The master weight (float32) arranged as its cast was (reshaped, transposed), once."""
    value = env[master]
    for i in chain:
        op = program.ops[i]
        value = bind_as_traced(op, [value, *[read(env, x) for x in op.ins[1:]]])[0]
    return value


@jax.custom_vjp
def _cast_like(master: jax.Array, cast: jax.Array) -> jax.Array:
    """``cast`` (``master`` already cast to a narrower dtype), its gradient sent to ``master``
    in the master's dtype: a loop over blocks sums a weight's gradient in float32 and casts
    the weight only once."""
    return cast


def _cast_like_fwd(master: jax.Array, cast: jax.Array) -> tuple[jax.Array, jax.Array]:
    return cast, jnp.zeros((0,), master.dtype)  # the master's dtype, nothing of its size


def _cast_like_bwd(dtype_of_master: jax.Array, cotangent: jax.Array) -> tuple[jax.Array, None]:
    return cotangent.astype(dtype_of_master.dtype), None


_cast_like.defvjp(_cast_like_fwd, _cast_like_bwd)


#: Primitives whose results (a block's per-token maximum, sum, log-sum-exp) the backward pass keeps.
_REDUCING = frozenset({"reduce_max", "reduce_min", "reduce_sum", "reduce", "argmax", "argmin"})


def _keep_reductions(prim: Any, *_: Any, **__: Any) -> bool:
    """A remat policy keeping a block's reductions over its logits: the backward pass then
    makes the block's logits again, but not the passes that reduce them."""
    return prim.name in _REDUCING


def _bind_block(op: Op, args: list, *, rows_of: dict, n: int, k: int) -> list:
    """One op of the region on a block of ``k`` rows: its shape params for ``n`` rows made ``k``."""
    reduced = reduced_op(op)
    if reduced is not None:  # a param's gradient in a reduce dtype: bound again on the block
        inner, reduce_dtype, leaves, split = reduced
        dtypes = [v.aval.dtype for v in inner.eqn.invars]
        arrays = [x if x.dtype == d else x.astype(d) for x, d in zip(args, dtypes)]
        params = {**inner.params, **_block_shapes(inner, rows_of, n, k)}
        cotangent = None if split.forward is None else np.dtype(dtypes[0])
        result = reductions.bind(inner.eqn.primitive, arrays, [x if leaf else None for x, leaf in zip(args, leaves)],
                                 params, reduce_dtype, input_grad=split.backward, cotangent=cotangent)
        return list(result) if inner.eqn.primitive.multiple_results else [result]
    if is_cross_entropy(op):  # precision.losses.cross_entropy: the same function on the block
        return list(cross_entropy_core(*args))
    return bind_as_traced(op, args, **_block_shapes(op, rows_of, n, k))


def _block_shapes(op: Op, rows_of: dict, n: int, k: int) -> dict:
    """The op's shape params for ``n`` rows made ``k`` (where its result carries rows, with its
    row factor)."""
    factors = [rows_of[out] for out in op.outs if out in rows_of]
    if not factors:
        return {}
    updates = {}
    for key in ("shape", "new_sizes", "slice_sizes", "limit_indices"):
        value = op.params.get(key)
        if isinstance(value, tuple) and value[:1] == (n * factors[0],):
            updates[key] = (k * factors[0], *value[1:])
    return updates


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"

