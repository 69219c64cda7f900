"""Where an equation of the rewritten program sits: the context every rule reads (the root
compute dtype, the op lists, the rules for higher-order primitives, the enclosing scope, the
decision log, FP8 and int8 runs) and the site of one equation (its scope, module, regions)."""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import numpy as np
from jax.extend.core import DropVar

from precision.autocast.op_lists import OpLists
from precision.autocast.regions import (module_path, region_dtype, region_fp8, region_int8, region_matmul,
                                        scope_names)
from precision.autocast.scaled.fp8_sites import Fp8Run
from precision.autocast.scaled.int8_sites import Int8Run

__all__ = ["Context", "Site", "site_of"]


@dataclasses.dataclass(frozen=True)
class Context:
    """What every equation's rule needs: the root compute dtype, the op lists,
    the rules for higher-order primitives, the scope of the enclosing equation,
    and where to log decisions."""

    root: np.dtype
    ops: OpLists
    rules: Mapping[str, Any]  # primitive name -> rule (jit, scan, cond... see higher_order.RULES)
    prefix: tuple[str, ...] = ()
    log: list | None = None
    root_fp8: bool = False  # the root's matmuls in FP8 (compute=f8)
    fp8: Fp8Run = dataclasses.field(default_factory=Fp8Run)
    reduce: np.dtype | None = None  # the dtype half ops' gradients are produced in (see .reductions)
    root_matmul: str = "default"  # the precision of float32 matmuls outside any region saying otherwise
    root_int8: bool = False  # the root's matmuls and convolutions in int8 (compute=int8)
    int8: Int8Run = dataclasses.field(default_factory=Int8Run)

    def at(self, prefix: tuple[str, ...], log: Any = ...) -> "Context":
        """The context of a part of this program at scope ``prefix`` (``log``: where its decisions go)."""
        return dataclasses.replace(self, prefix=prefix, log=self.log if log is ... else log)

    def nested(self, prefix: tuple[str, ...], log: Any = ...) -> "Context":
        """The context of a sub-program traced apart (a loop body...): FP8 state out of reach."""
        return dataclasses.replace(self.at(prefix, log), fp8=self.fp8.nested())


@dataclasses.dataclass
class Site:
    """One equation being rewritten, with where it sits."""

    eqn: Any
    scope: tuple[str, ...]
    path: tuple[str, ...]
    region: np.dtype
    demanded: bool  # its floating outputs only feed float32 ops
    fp8: bool = False  # in an FP8 region: its allow-listed matmul may be FP8
    matmul: str = "default"  # the least precision of a float32 matmul here (see .matmul_precision)
    int8: bool = False  # in an int8 region: its allow-listed matmul or convolution may be int8
    bias: list | None = None  # [a bias Val] its int8 product adds itself, emptied where it does (.int8_sites)
    heads_input: Any = None  # its input before (heads, head size) were merged: what an int8 product reads
    activation: Any = None  # (Activation, its input's Val): an int8 product reads the input, applies it (.int8_activation)
    f32_result: bool = False  # its result is the program's float32 output: an int8 product writes it so (.int8_sites)

    @property
    def name(self) -> str:
        return self.eqn.primitive.name


def site_of(eqn: Any, demanded: set, ctx: Context) -> Site:
    """``eqn`` with where it sits: its scope, module and regions."""
    scope = ctx.prefix + scope_names(eqn.source_info.name_stack)
    return Site(eqn, scope, module_path(scope), region_dtype(scope, ctx.root),
                any(v in demanded for v in eqn.outvars if not isinstance(v, DropVar)),
                region_fp8(scope, ctx.root_fp8), region_matmul(scope, ctx.root_matmul), region_int8(scope, ctx.root_int8))
