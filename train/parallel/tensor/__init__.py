"""Tensor (and sequence) parallelism: how the mesh's ``tensor`` axis splits a model, found in
its traced program (:mod:`.finder`), overridden by ``sharding.rules`` (:mod:`.planning`), kept
as a :class:`TensorPlan` (:mod:`.plan`) and written into each step's program (:mod:`.rewrite`).
docs/tensor-parallelism.md says what it splits and what each collective sends."""

from train.parallel.tensor.plan import Kept, Split, TensorPlan
from train.parallel.tensor.planning import TensorLayoutError, find_layout, parse_rules, plan_of, tensor_pass

__all__ = ["Kept", "Split", "TensorPlan", "TensorLayoutError", "find_layout", "parse_rules", "plan_of", "tensor_pass"]
