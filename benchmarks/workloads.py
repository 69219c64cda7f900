"""What the suite measures: three models at three sizes, and six precision policies.

Models (plain Flax modules from :mod:`train.models`, unchanged):
  ``mlp``     the seed-001 network: three 4096x4096 Linear layers, ReLU between,
              at batch 512 (a 4096-way classifier here, as train_step's loss is
              cross-entropy);
  ``resnet``  the Fashion-MNIST ResNet of ``configs/fmnist_resnet_*.yaml``;
  ``gpt``     the Shakespeare GPT of ``configs/shakespeare_gpt_*.yaml`` at a batch
              where activations dominate memory (65-token vocabulary);
  ``gpt2_small`` GPT-2 small at its real (padded) vocabulary of 50,304 tokens and
              an untied head: at ``gpu`` size the shape of
              ``configs/gpu/gpt2_small_mixed_bf16.yaml`` (12 x 768, 16 x 1024 tokens),
              the workload llm.c's MFU figures are for.
Each also comes *pinned* (``mlp_pinned``...): the same model with every layer's
``dtype=jnp.float32`` set, the way Flax's examples and most published models are
written; a policy must reach it as fully as the unpinned one.
Sizes: ``full`` (those), ``quick`` (small enough for 2 CPU cores in minutes) and
``gpu`` (larger, to fill an accelerator). Inputs are random: speed and memory do
not depend on the data's values.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from train.models import GPT, MLP, ResNet

SIZES = ("quick", "full", "gpu")


@dataclasses.dataclass(frozen=True)
class Workload:
    """A model and the batch it trains on."""

    name: str
    model: Any
    inputs: jax.ShapeDtypeStruct
    num_classes: int
    tokens_per_example: int = 1  # > 1: a language model, throughput in tokens
    rules: Any = None  # None: the preset's rules (norms in float32)

    @property
    def batch_size(self) -> int:
        return self.inputs.shape[0]

    def batch(self, seed: int = 0) -> dict[str, jax.Array]:
        """A random batch of the right shapes and dtypes."""
        rng = np.random.default_rng(seed)
        if jnp.issubdtype(self.inputs.dtype, jnp.integer):
            inputs = rng.integers(0, self.num_classes, self.inputs.shape)
            labels = rng.integers(0, self.num_classes, self.inputs.shape)
        else:
            inputs = rng.standard_normal(self.inputs.shape, np.float32)
            labels = rng.integers(0, self.num_classes, self.inputs.shape[:1])
        return {"inputs": jnp.asarray(inputs, self.inputs.dtype), "labels": jnp.asarray(labels, jnp.int32)}

    def describe(self) -> str:
        return f"{type(self.model).__name__} {dict(_fields(self.model))}, inputs {self.inputs.dtype}{list(self.inputs.shape)}"


def _fields(module: Any) -> dict:
    return {f.name: getattr(module, f.name) for f in dataclasses.fields(module)
            if f.name not in ("parent", "name")}


def _mlp(width: int, batch: int) -> Workload:
    model = MLP(hidden=(width, width), num_classes=width, layer_norm=False)
    return Workload("mlp", model, jax.ShapeDtypeStruct((batch, width), jnp.float32), width)


def _resnet(stages: tuple[int, ...], width: int, batch: int) -> Workload:
    return Workload("resnet", ResNet(stage_sizes=stages, width=width),
                    jax.ShapeDtypeStruct((batch, 28, 28), jnp.float32), 10)


GPT2_VOCAB = 50304  # GPT-2's 50,257 tokens padded to a multiple of 128


def _gpt(layers: int, heads: int, d_model: int, seq: int, batch: int, vocab: int = 65,
         name: str = "gpt") -> Workload:
    model = GPT(vocab_size=vocab, block_size=seq, num_layers=layers, num_heads=heads, d_model=d_model)
    return Workload(name, model, jax.ShapeDtypeStruct((batch, seq), jnp.int32), vocab, tokens_per_example=seq)


MODEL_FLOPS_FORMULA = ("6 N + 12 L d T per token (PaLM's appendix B, nanoGPT's estimate_mfu): N the params "
                       "that multiply (12 L d^2 in the blocks + V d in the untied head; embeddings are "
                       "lookups), L layers, d width, T sequence length; attention counted whole, not halved "
                       "for the causal mask")


def model_flops_per_step(w: Workload) -> float | None:
    """Training FLOPs of one step of a GPT workload by the usual formula
    (:data:`MODEL_FLOPS_FORMULA`), the numerator of MFU as llm.c and nanoGPT report it;
    None for other models."""
    m = w.model
    if not isinstance(m, GPT):
        return None
    layers, d, seq = m.num_layers, m.d_model, w.tokens_per_example
    matmul_params = layers * (4 + 2 * m.mlp_ratio) * d * d + m.vocab_size * d
    return (6 * matmul_params + 12 * layers * d * seq) * w.batch_size * seq


_BUILDERS: dict[str, dict[str, Callable[[], Workload]]] = {
    "mlp": {"quick": lambda: _mlp(1024, 128), "full": lambda: _mlp(4096, 512), "gpu": lambda: _mlp(4096, 512)},
    "resnet": {"quick": lambda: _resnet((1,), 16, 16), "full": lambda: _resnet((1, 1, 1), 16, 128),
               "gpu": lambda: _resnet((2, 2, 2), 64, 256)},
    "gpt": {"quick": lambda: _gpt(1, 4, 128, 128, 8), "full": lambda: _gpt(4, 4, 128, 128, 64),
            "gpu": lambda: _gpt(12, 12, 768, 1024, 16)},
    "gpt2_small": {"quick": lambda: _gpt(1, 2, 64, 64, 4, GPT2_VOCAB, "gpt2_small"),
                   "full": lambda: _gpt(2, 4, 128, 256, 8, GPT2_VOCAB, "gpt2_small"),
                   "gpu": lambda: _gpt(12, 12, 768, 1024, 16, GPT2_VOCAB, "gpt2_small")},
}
_BUILDERS.update({f"{name}_pinned": {size: (lambda build=build: _pinned(build())) for size, build in sizes.items()}
                  for name, sizes in list(_BUILDERS.items())})
MODELS = tuple(_BUILDERS)
#: Models whose real vocabulary (50,304) dominates a small model's step: measured at ``full`` and
#: ``gpu`` sizes, not by default at ``quick`` (on 2 CPU cores their 1-layer quick steps took
#: seconds each, most of a quick run); ``--models gpt2_small`` still asks for one.
LARGE_VOCABULARY = ("gpt2_small", "gpt2_small_pinned")


def default_models(size: str) -> tuple[str, ...]:
    """The models a run at ``size`` measures unless told which: all, less the large-vocabulary
    ones at ``quick`` size."""
    return tuple(m for m in MODELS if size != "quick" or m not in LARGE_VOCABULARY)


def _pinned(w: Workload) -> Workload:
    return dataclasses.replace(w, name=f"{w.name}_pinned", model=w.model.clone(dtype=jnp.float32))


def workload(name: str, size: str) -> Workload:
    """The benchmark model ``name`` (``mlp``, ``resnet``, ``gpt``, each also ``_pinned``) at ``size``."""
    if name not in _BUILDERS:
        raise ValueError(f"unknown benchmark model {name!r}; valid: {', '.join(MODELS)}")
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; valid: {', '.join(SIZES)}")
    return _BUILDERS[name][size]()


@dataclasses.dataclass(frozen=True)
class PolicyCase:
    """A row of the table: a policy preset, its loss scale and matmul precision."""

    name: str
    policy: str
    loss_scale: str = "auto"
    matmul_precision: str | None = None  # None: JAX's default
    description: str = ""


POLICIES = (
    PolicyCase("fp32", "fp32", "none", None, "float32, default matmul precision (TF32 on recent GPUs)"),
    PolicyCase("fp32_highest", "fp32", "none", "highest", "float32, full-precision matmuls"),
    PolicyCase("mixed_bf16", "mixed_bf16", "none", None, "f32 params, bf16 compute, norms f32"),
    PolicyCase("mixed_f16", "mixed_f16", "dynamic", None, "f32 params, f16 compute, dynamic loss scale"),
    PolicyCase("pure_bf16", "pure_bf16", "none", None, "bf16 params and compute, f32 master weights"),
    PolicyCase("O2", "O2", "dynamic", None, "f16 params with f32 master weights, f32 norms, dynamic scale"),
)
#: Rows measured only when asked for (``--policies``): int8 GEMMs need a GPU or TPU to mean anything.
EXTRA_POLICIES = (
    PolicyCase("mixed_int8", "mixed_int8", "none", None, "f32 params, int8 matmuls (per-row scales), the rest bf16"),
)
DEFAULT_POLICY_NAMES = tuple(p.name for p in POLICIES)
POLICY_NAMES = DEFAULT_POLICY_NAMES + tuple(p.name for p in EXTRA_POLICIES)


def policy_case(name: str) -> PolicyCase:
    """The policy row called ``name``."""
    for case in POLICIES + EXTRA_POLICIES:
        if case.name == name:
            return case
    raise ValueError(f"unknown benchmark policy {name!r}; valid: {', '.join(POLICY_NAMES)}")
