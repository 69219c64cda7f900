"""The experiment schema: typed sections whose validation fails before any
compute with one line naming the key.

A config file is YAML with the sections ``model``, ``data``, ``optimizer``,
``precision``, ``mesh``, ``distributed``, ``tracker`` (:mod:`.tracker`) and ``finetune``
(:mod:`.finetune`) plus top-level run settings; every
field has a default, so a file only says what differs. ``python -m train --help``
lists every field.

Why pydantic (v2), rather than draccus or a hand-written schema: fields are
typed declarations (``Field(default, description=...)``, ``Literal`` choices,
``ge``/``gt`` ranges) that pydantic checks; ``extra="forbid"`` rejects unknown
keys; every error has its exact location (``loc``), which
:func:`train.config.errors.error_message` turns into one line naming the dotted
key; the same declarations give ``--help`` and a JSON schema
(``ExperimentConfig.model_json_schema()``); and it is ubiquitous and well kept.
draccus maps dataclasses to argparse but leaves the validation and its messages
to us. Fields are strict (``"10"`` is not an integer, ``1`` is not ``true``),
except that numbers accept YAML 1.1's ``1e-3`` strings.
"""

from typing import Annotated, Any, Literal

from pydantic import (BaseModel, BeforeValidator, Field, PrivateAttr, ValidationError, ValidationInfo, field_validator,
                      model_validator)

import precision
from train.config.errors import ConfigError, error_message, invalid
from train.config.section import Section, unset_nulls
from train.config.optimizer import OptimizerConfig
from train.config.fields import (CLASS_REFERENCE, FUNCTION_REFERENCE, INFERENCE_DTYPES, Count, DataName,
                                 InferenceDtype, ModelName, NonNegative, Number, Task, options_schema)
from train.config.tracker import TrackerConfig
from train.config.finetune import FinetuneConfig, LoraConfig
from train.config.sharding import ShardingConfig
from train.config.precision_objects import build_loss_scale, build_op_lists
from train.data import DATASETS
from train.data.model_inputs import INPUTS_AS
from train.models import MODELS
from train.references import is_reference

__all__ = ["ExperimentConfig", "ModelConfig", "DataConfig", "OptimizerConfig", "PrecisionConfig", "MeshConfig",
           "ShardingConfig", "DistributedConfig", "SECTIONS", "build_loss_scale", "build_op_lists"]


_Schema = Section


class ModelConfig(_Schema):
    """``name`` picks the model and ``output`` the part of its output the loss reads;
    every other key of the ``model`` section lands in ``options``: the fields of a
    built-in model (checked here) or a class reference's constructor keyword
    arguments (taken as they are). A mapping under ``model.options`` is merged in too."""

    name: ModelName = Field("mlp", description=f"model: {', '.join(MODELS)}, or a class reference {CLASS_REFERENCE[1]}")
    options: dict[str, Any] = Field({}, description="the model's own fields (listed below per model)")
    output: str | int | None = Field(None, description="for a model whose output is not one array (a dict, a "
                                                       "ModelOutput, a dataclass, a tuple): the key, attribute or "
                                                       "index the loss reads, e.g. logits (null: the whole output)")
    init_from: str | None = Field(None, min_length=1, description="start from pretrained weights: another run's "
                                  "workdir (or its checkpoints/ or one step's directory) or a Hugging Face Flax "
                                  "save_pretrained directory (docs/fine-tuning.md); ignored when resuming")
    _origins: dict[str, str] = PrivateAttr(default_factory=dict)  # option -> where it was set: a file, the command line

    def origin(self, key: str) -> str:
        """`` (from FILE)`` or `` (from the command line)`` for an option read by :func:`load_config`, else ``""``."""
        return f" (from {self._origins[key]})" if key in self._origins else ""

    @model_validator(mode="before")
    @classmethod
    def _gather_options(cls, raw: Any) -> Any:
        if isinstance(raw, dict) and isinstance(raw.get("options", {}), dict):
            rest = {k: v for k, v in raw.items() if k not in ("name", "options", "output", "init_from")}
            raw = {**{k: raw[k] for k in ("name", "output", "init_from") if k in raw},
                   "options": {**raw.get("options", {}), **rest}}
        return raw

    @model_validator(mode="after")  # (a model validator reruns when either field is assigned)
    def _model_fields(self) -> "ModelConfig":
        if self.name in MODELS:  # a class reference's signature is checked when the model is built
            schema = options_schema(self.name)
            for key in set(self.options) - set(unset_nulls(self.options, schema.model_fields)):
                del self.options[key]  # model.hidden=null: the model's default
            try:
                checked = schema.model_validate({**self.options, "name": self.name})
            except ValidationError as e:
                raise invalid(error_message(e.errors()[0], schema, ("model",))) from None
            self.options.update((k, getattr(checked, k)) for k in self.options)
        return self


def _lower(value: Any) -> Any:
    return value.strip().lower() if isinstance(value, str) else value


class DataConfig(_Schema):
    name: DataName = Field("digits", description=f"dataset: {', '.join(DATASETS)}, or a function reference "
                                                 f"{FUNCTION_REFERENCE[1]}")
    options: dict[str, Any] = Field({}, description="keyword arguments of a user data function "
                                                    "(data.name: module:function)")
    path: str | None = Field(None, min_length=1, description="your own files: Fashion-MNIST IDX directory or a text "
                                                            "file")
    batch_size: Count = Field(128, description="examples per micro-batch; a step sees batch_size * accum_steps")
    eval_batch_size: Count = Field(512, description="examples per eval batch")
    eval_batches: int | None = Field(None, ge=1, description="evaluate on at most this many batches (null: all)")
    seq_len: Count = Field(128, description="characters per training window (text datasets)")
    val_fraction: Number = Field(0.1, gt=0, lt=1, description="tail of the text held out for validation "
                                                              "(text datasets)")
    num_train: Count = Field(4096, description="training examples (synthetic datasets)")
    num_test: Count = Field(1024, description="test examples (synthetic datasets)")
    input_shape: list[Count] = Field([32], description="shape of one input (synthetic)")
    num_classes: Count = Field(10, description="classes, or vocabulary size for synthetic_text (synthetic datasets)")
    prefetch: NonNegative = Field(2, description="batches kept in flight to the device (0: none)")
    inputs_as: Annotated[Literal[INPUTS_AS], BeforeValidator(_lower)] = Field(
        "auto", description="a dict of inputs: kwargs (model(**inputs)), dict (model(inputs)), or auto: kwargs "
                            "where its keys are parameters of the model's __call__, dict where it takes one input")

    @model_validator(mode="after")
    def _options_for_functions(self) -> "DataConfig":
        if self.options and not is_reference(self.name):
            raise invalid(f"data.options: only a user data function (data.name: module:function) takes options; "
                           f"the built-in dataset {self.name!r} reads the data.* keys")
        return self


class Fp8Config(_Schema):
    """FP8 matmuls of a policy whose compute is f8 (``mixed_fp8``): see ``precision.fp8_options``."""

    scaling: Annotated[Literal[precision.fp8.SCALINGS], BeforeValidator(_lower)] = Field(
        "current", description="current: each tensor scaled from its own amax; delayed: from the amax history "
                               "(state checkpointed with the model); rowwise: a scale per row of the activation "
                               "and per column of the weight")
    history: int = Field(precision.fp8.DEFAULT_HISTORY, ge=1, description="steps of amax kept (delayed scaling)")
    min_size: int = Field(precision.fp8.DEFAULT_MIN_SIZE, ge=0,
                          description="a matmul is fp8 only when each of M, K, N is at least this (0: every matmul)")
    attention: bool = Field(False, description="attention's batched products (q.k^T, probabilities.v) in fp8 too; "
                                               "false keeps them in the fallback dtype")

    def options(self) -> precision.Fp8Options:
        """The options as ``precision.fp8_options`` builds them."""
        return precision.fp8_options(self.scaling, self.history, self.min_size, self.attention)


class Int8Config(_Schema):
    """Int8 matmuls of a policy whose compute is int8 (``mixed_int8``): see ``precision.int8_options``."""

    backward: Annotated[Literal[precision.int8.BACKWARDS], BeforeValidator(_lower)] = Field(
        "int8", description="the two backward matmuls (input and weight gradients): int8 (each operand quantized "
                            "again along the axes it contracts) or bf16 (the fallback dtype)")
    stochastic_rounding: bool = Field(False, description="round the output gradient to int8 stochastically (noise "
                                                         "keyed by the gradient's own bits: deterministic, resumable)")
    min_size: int = Field(precision.int8.DEFAULT_MIN_SIZE, ge=0,
                          description="a matmul or convolution is int8 only when each of M, K, N is at least this "
                                      "(0: every one)")
    attention: bool = Field(False, description="attention's batched products (q.k^T, probabilities.v) in int8 too; "
                                               "false keeps them in the fallback dtype")
    tpu_kernels: bool = Field(True, description="on one TPU, plain int8 matmuls in Pallas kernels that quantize in "
                                                "VMEM (modeled, not measured); false: XLA's recipe there too")

    def options(self) -> precision.Int8Options:
        """The options as ``precision.int8_options`` builds them."""
        return precision.int8_options(self.backward, self.stochastic_rounding, self.min_size, self.attention,
                                      self.tpu_kernels)


def _blockwise_mode(value: Any) -> Any:
    """``precision.blockwise_loss``: auto, or true / false (YAML's spellings of them)."""
    if isinstance(value, bool) or value == "auto":
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "false", "on", "off", "yes", "no"):
        return value.strip().lower() in ("true", "on", "yes")
    raise invalid(f"precision.blockwise_loss: {value!r}; valid: auto (from 8 GiB of float32 logits), true (from "
                  f"256 MiB), false (never)")


class PrecisionConfig(_Schema):
    policy: str = Field("fp32", description=f"policy string or preset ({', '.join(precision.PRESETS)})")
    rules: list | None = Field(None, description="per-module rules [[pattern, policy], ...]; null: the preset's "
                                                 "(norms in f32; O1 adds softmax)")
    loss_scale: Annotated[Literal[precision.LOSS_SCALE_KINDS], BeforeValidator(_lower)] = Field(
        "auto", description=f"{', '.join(precision.LOSS_SCALE_KINDS)} (auto: dynamic for float16, none otherwise)")
    initial_scale: Number = Field(2.0 ** 15, gt=0, description="initial (or static) loss scale (> 0: a scale of 0 "
                                                               "makes every gradient 0/0 and skips every step)")
    growth_interval: int = Field(2000, description="finite steps before a dynamic scale grows")
    growth_factor: Number = Field(2.0, description="dynamic scale growth factor")
    backoff_factor: Number = Field(0.5, description="dynamic scale back-off factor")
    min_scale: Number = Field(1.0, gt=0, description="smallest dynamic loss scale (> 0)")
    max_scale: Number = Field(2.0 ** 24, description="largest dynamic loss scale")
    hysteresis: int = Field(1, description="consecutive non-finite steps before backing off")
    skip_with: Literal[precision.optim.SKIP_STRATEGIES] = Field(
        "auto", description=f"how non-finite steps are skipped: {', '.join(precision.optim.SKIP_STRATEGIES)}")
    autocast: bool = Field(True, description="rewrite every op of the model to the policy, whatever dtypes its "
                                             "layers pin (false: cast only at module boundaries)")
    allow: list[str] = Field([], description="primitives added to the allow list (run in the compute dtype), "
                                             "e.g. [exp]")
    deny: list[str] = Field([], description="primitives added to the deny list (run in float32), e.g. [tanh]")
    follow: list[str] = Field([], description="primitives removed from both lists (follow their inputs)")
    fuse_attention: bool = Field(True, description="softmax attention a model writes out (Flax's "
                                                   "dot_product_attention, einsum-softmax-einsum) computed as one "
                                                   "fused attention call under a half policy (cuDNN's on a GPU) "
                                                   "where that is the same computation")
    fuse_norms: bool = Field(True, description="layer, RMS and batch norms a model writes out (Flax's "
                                               "LayerNorm, RMSNorm, BatchNorm, hand-written ones) differentiated in closed form: the "
                                               "same forward, a backward in fewer kernels")
    split_projections: bool = Field(True, description="a fused projection split after its matmul (query, key and value "
                                                      "made by one matmul) computed as one matmul per part in a program "
                                                      "for one TPU: the same values, without layout copies")
    blockwise_loss: Annotated[Literal["auto"] | bool, BeforeValidator(_blockwise_mode)] = Field(
        "auto", description="a loss from large logits (a language model's) computed a block of rows at a time, the "
                            "logits never whole in either pass, where that is the same computation: auto from 8 GiB "
                            "of float32 logits, true from 256 MiB (less memory, one more pass of the head), false never")
    strict: bool = Field(False, description="fail, instead of warning, when the policy leaves more than 5% of the "
                                            "model's matmul/conv FLOPs in float32")
    fp8: Fp8Config = Field(default_factory=Fp8Config, description="fp8 matmuls (policy mixed_fp8 or compute=f8)")
    int8: Int8Config = Field(default_factory=Int8Config, description="int8 matmuls (policy mixed_int8 or "
                                                                     "compute=int8)")
    reduce_dtype: str = Field("auto", description="dtype gradients are reduced across devices in: f32, bf16, f16 "
                                                  "(needs a loss scale); auto: f32 on a mesh of more than one "
                                                  "device")
    tensor_reduce_dtype: str = Field("f32", description="dtype the partial sums of matmuls split over mesh.tensor "
                                                        "are summed across its devices in (row-parallel results, "
                                                        "column-parallel input gradients): f32, or bf16 / f16 for "
                                                        "half the bytes and some drift of the loss")

    @field_validator("policy")
    @classmethod
    def _parses(cls, policy: str) -> str:
        try:
            precision.get_policy(policy)
        except precision.PolicyError as e:
            raise invalid(f"precision.policy: {e}") from None
        return policy

    @field_validator("reduce_dtype", "tensor_reduce_dtype")
    @classmethod
    def _reduce_dtype_parses(cls, value: str, info: ValidationInfo) -> str:
        auto = info.field_name == "reduce_dtype"  # auto: float32 on a mesh; tensor sums have no auto
        if auto and value.strip().lower() == "auto":
            return "auto"
        try:
            precision.reduce_dtype_of(value)
        except precision.PolicyError as e:
            raise invalid(f"precision.{info.field_name}: {str(e).removeprefix('reduce_dtype: ')}"
                          f"{'; or auto' if auto else ''}") from None
        return value

    @field_validator("rules")
    @classmethod
    def _rules_parse(cls, rules: list | None) -> list | None:
        try:
            rules is None or precision.rules.as_rules(rules)
        except (TypeError, precision.PolicyError) as e:
            raise invalid(f"precision.rules: {str(e).rstrip('.')}. Write rules as [[pattern, policy], ...], "
                           f"e.g. [[LayerNorm, f32], [Softmax, f32]]") from None
        return rules

    @model_validator(mode="after")
    def _builds(self) -> "PrecisionConfig":
        try:
            build_loss_scale(self)
            build_op_lists(self)
        except ConfigError as e:
            raise invalid(str(e)) from None
        return self


class MeshConfig(_Schema):
    data: int = Field(-1, description="devices the batch is split over (-1: all devices that fsdp and tensor leave)")
    fsdp: Count = Field(1, description="devices params and optimizer state are split over (FSDP); the batch is "
                                       "split over them too")
    tensor: Count = Field(1, description="devices each layer's matmuls are split over (tensor parallelism: the "
                                         "pairs of attention and the MLP, the vocabulary, found in the model's "
                                         "program); adjacent devices inside one host; the batch is whole over them")
    sequence_parallel: bool = Field(True, description="with mesh.tensor > 1: activations between the split layers "
                                                      "(norms, dropout, residual adds) split along the sequence over "
                                                      "the tensor devices (Megatron-SP); false: whole on each")
    fsdp_min_size: NonNegative = Field(1024, description="arrays with fewer elements stay replicated under fsdp")

    @field_validator("data")
    @classmethod
    def _devices(cls, data: int) -> int:
        if data < 1 and data != -1:
            raise invalid(f"mesh.data must be >= 1, or -1 for all devices, got {data}")
        return data


class DistributedConfig(_Schema):
    coordinator_address: str | None = Field(None, description="host:port of process 0 for a multi-process run "
                                                              "(or env JAX_COORDINATOR_ADDRESS); null: single process")
    num_processes: int | None = Field(None, ge=1, description="processes in the run (or env JAX_NUM_PROCESSES)")
    process_id: int | None = Field(None, ge=0, description="this process's index, 0 .. num_processes-1 "
                                                           "(or env JAX_PROCESS_ID)")
    cluster_detect: bool = Field(False, description="let JAX detect the cluster (SLURM, Open MPI, Kubernetes, TPU)")
    timeout_seconds: Count = Field(300, description="how long processes wait for each other to start")

    @field_validator("coordinator_address")
    @classmethod
    def _host_port(cls, address: str | None) -> str | None:
        host, sep, port = (address or "").rpartition(":")
        if address is not None and not (sep and host and port.isdigit() and 0 < int(port) < 65536):
            raise invalid(f"distributed.coordinator_address must be host:port (e.g. 10.0.0.1:1234), got {address!r}")
        return address

    @model_validator(mode="after")
    def _process_id_below_num_processes(self) -> "DistributedConfig":
        n, i = self.num_processes, self.process_id
        if i is not None and n is not None and i >= n:
            raise invalid(f"distributed.process_id must be < distributed.num_processes={n}, got {i}")
        return self


class ExperimentConfig(_Schema):
    seed: NonNegative = Field(0, description="seed of params, dropout and data order")
    workdir: str = Field("runs/default", min_length=1, pattern=r"\S",
                         description="where metrics, config, checkpoints and TensorBoard files go")
    steps: Count = Field(1000, description="optimizer steps to train to (a larger value continues a finished run)")
    accum_steps: Count = Field(1, description="micro-batches accumulated per optimizer step")
    steps_per_call: Count = Field(1, description="train steps per device call: more (e.g. 50) for a model whose "
                                                 "step is too short to hide the host's per-call work (a call's "
                                                 "batches go to the device together)")
    log_every: Count = Field(50, description="steps between metrics records")
    eval_every: NonNegative = Field(0, description="steps between evaluations (0: only at the end)")
    checkpoint_every: NonNegative = Field(500, description="steps between checkpoints (0: only at the end)")
    keep_checkpoints: Count = Field(3, description="checkpoints kept")
    max_nonfinite_steps: Count = Field(100, description="stop after this many consecutive non-finite steps at the "
                                                        "minimum loss scale")
    inference_dtypes: list[InferenceDtype] = Field(list(INFERENCE_DTYPES), description=(
        "half dtypes whose inference accuracy is compared with float32 at the end ([] to skip)"))
    progress: bool = Field(True, description="show a progress bar")
    compile_cache: str | None = Field("auto", min_length=1, description="persistent compilation cache directory, so a rerun or "
                                                          "resumption compiles nothing (auto: $MP_COMPILE_CACHE_DIR, "
                                                          "$JAX_COMPILATION_CACHE_DIR or ~/.cache/flax-mixed-precision"
                                                          "/jax; null: off)")
    task: Task = Field("auto", description=f"the loss: auto (from the data), classification, lm (or language_model), "
                                           f"or a function reference {FUNCTION_REFERENCE[1]} to "
                                           f"fn(outputs, batch) -> (loss, metrics)")
    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig)
    precision: PrecisionConfig = Field(default_factory=PrecisionConfig)
    mesh: MeshConfig = Field(default_factory=MeshConfig)
    sharding: ShardingConfig = Field(default_factory=ShardingConfig)
    distributed: DistributedConfig = Field(default_factory=DistributedConfig)
    tracker: TrackerConfig = Field(default_factory=TrackerConfig)
    finetune: FinetuneConfig = Field(default_factory=FinetuneConfig)

    @field_validator("model", "data", "optimizer", "precision", "mesh", "sharding", "distributed", "tracker",
                     "finetune", mode="before")
    @classmethod
    def _empty_section(cls, section: Any) -> Any:
        return {} if section is None else section  # a section header with nothing under it


#: The sections of an experiment config, by key.
SECTIONS = {name: f.annotation for name, f in ExperimentConfig.model_fields.items()
             if isinstance(f.annotation, type) and issubclass(f.annotation, BaseModel)}
for _key, _section in SECTIONS.items():
    _section.dotted_key = _key
Fp8Config.dotted_key = "precision.fp8"
Int8Config.dotted_key = "precision.int8"
LoraConfig.dotted_key = "finetune.lora"
