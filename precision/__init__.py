"""precision: mixed-precision training for JAX/Flax.

Policies parsed from strings (``"params=f32,compute=f16"`` or a preset),
applied to unmodified Flax modules with per-module rules; loss scales whose
state lives in the train state; an optax wrapper that unscales, skips
non-finite steps, keeps float32 master weights and adjusts the loss scale;
a numerics doctor (``diagnose``) that names where half precision fails and
verifies the fix; FP8 matmuls (``mixed_fp8``, :func:`fp8_options`) and int8 ones
(``mixed_int8``, :func:`int8_options`) on any model.
The jmp API is a subset: ``import precision as jmp`` runs jmp code.
"""

from precision.policy import (
    PRESETS,
    Policy,
    PolicyError,
    cast_to_full,
    cast_to_half,
    get_policy,
    half_dtype,
    parse_dtype,
)
from precision.loss_scale import (
    LOSS_SCALE_KINDS,
    DynamicLossScale,
    LossScale,
    NoOpLossScale,
    ScalarBoolError,
    StaticLossScale,
    all_finite,
    get_loss_scale,
    select_tree,
)
from precision.rules import (
    NORM_CLASSES,
    SOFTMAX_PATTERNS,
    Rule,
    default_rules,
    get_rules,
    norm_rules,
)
from precision.fp8 import FP8_COLLECTION, Fp8Options, combine_fp8_states, fp8_options, init_fp8_state
from precision.int8 import Int8Options, int8_options
from precision.autocast import (ALLOW, DENY, OpLists, autocast, compute_in, op_lists, program_pass, reduce_dtype_of,
                                split_sums)
from precision.modules import LinenWithPolicy, NNXWithPolicy, with_policy
from precision.reads import read_dtypes
from precision.explain import (CoverageError, Explanation, PrecisionWarning, check_coverage, explain)
from precision.doctor import Diagnosis, Problem, Recommendation, diagnose
from precision.optim import (
    MixedPrecisionState,
    current_loss_scale,
    find_mixed_precision_state,
    full_precision_params,
    mixed_precision,
    needs_master_weights,
)
from precision.evaluation import evaluation_params, keeps_evaluation_point
from precision.state_memory import state_bytes
from precision.pick import Candidate, Measurement, PolicyPick, pick_policy
from precision.stored import accumulate, stochastic_round, stored_in
from precision.losses import cross_entropy
from precision.blockwise import Plan as BlockwisePlan, blockwise_loss, plan as plan_blockwise_loss
from precision.quantized_weights import QuantizedWeight, dequantized, quantize_weight
from precision.autocast.fused_attention import forward_only

__version__ = "0.1.0"

__all__ = (
    "PRESETS", "Policy", "PolicyError", "cast_to_full", "cast_to_half", "get_policy",
    "half_dtype", "parse_dtype",
    "LOSS_SCALE_KINDS", "DynamicLossScale", "LossScale", "NoOpLossScale", "ScalarBoolError", "StaticLossScale",
    "all_finite", "get_loss_scale", "select_tree",
    "NORM_CLASSES", "SOFTMAX_PATTERNS", "Rule", "default_rules", "get_rules", "norm_rules",
    "FP8_COLLECTION", "Fp8Options", "combine_fp8_states", "fp8_options", "init_fp8_state",
    "Int8Options", "int8_options",
    "ALLOW", "DENY", "OpLists", "op_lists", "compute_in", "autocast", "forward_only", "reduce_dtype_of",
    "program_pass", "split_sums",
    "LinenWithPolicy", "NNXWithPolicy", "with_policy",
    "CoverageError", "Explanation", "PrecisionWarning", "check_coverage", "explain", "read_dtypes",
    "Diagnosis", "Problem", "Recommendation", "diagnose",
    "MixedPrecisionState", "current_loss_scale", "find_mixed_precision_state",
    "full_precision_params", "mixed_precision", "needs_master_weights", "evaluation_params",
    "keeps_evaluation_point",
    "accumulate", "state_bytes", "stochastic_round", "stored_in",
    "Candidate", "Measurement", "PolicyPick", "pick_policy",
    "BlockwisePlan", "blockwise_loss", "cross_entropy", "plan_blockwise_loss",
    "QuantizedWeight", "dequantized", "quantize_weight",
)

# Before the autocast package, its modules lived at the top level: their import paths
# (``from precision.op_lists import OpLists``, ``from precision import fused_attention``) keep working.
import sys as _sys  # noqa: E402

from precision.autocast import fused_attention, higher_order, interpreter, program, regions, transform  # noqa: E402,F401

for _name in ("fused_attention", "higher_order", "interpreter", "op_lists", "program", "regions", "transform"):
    _sys.modules.setdefault(f"{__name__}.{_name}", _sys.modules[f"{__name__}.autocast.{_name}"])
del _sys, _name
