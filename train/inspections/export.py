"""``python -m train export RUN --dtype bf16 OUT``: a trained run's weights for serving.

The newest checkpoint's params are read as :func:`train.load_pretrained` reads them (float32
masters where the run kept them), a frozen base stored in 8/4-bit codes is read back as
float32, LoRA adapters are merged into the weights they adapt (their layout found by one
backward pass of the LoRA model, and the merged model checked against it), and every floating
param is cast to the dtype asked for, except the params of modules the run's precision rules
keep in float32 (normalization layers, by default): the framework's own casting by module path
and class (:func:`train.cast_variables`), as half-precision inference casts them. OUT is a
Hugging Face directory for a model read from one (``train.weights.huggingface:model``), else
``params.safetensors``; both with ``export.json``, and both read by ``model.init_from``.
The pure parts (files, codes, adapters' layouts) are :mod:`train.weights.export`.
"""

from __future__ import annotations

import os
from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx, traverse_util

import precision
from precision.channel_weights import dequantize_channels, is_channel_int8
from precision.contractions import contracted_axes
from precision.rules import Rule, as_rules
from train.config import ConfigError, load_run_config
from train.data import DataError
from train.data.model_inputs import call_with
from train.experiment.builders import build_experiment
from train.experiment.fits import format_bytes
from train.finetune import FineTune, LoRA, finetune_model
from train.training.binding import bind, cast_variables, inputs_as_for, mode_kwargs, rebind
from train.training.diagnose import diagnose_inference, summary_line, write_diagnosis
from train.training.inference import inference_report
from train.training.state import create_train_state
from train.weights.export import (MANIFEST, ExportError, ExportReport, adapter_layouts, adapter_pairs, dequantized_base,
                                  export_dtype, lora_delta, pick_layout, staged, stored_codes, write_huggingface,
                                  write_manifest, write_params)
from train.weights.huggingface import TokenIds
from train.weights.int8 import channel_arrays, int8_weights
from train.weights.pretrained import PretrainedError, checkpoint_steps, find_pretrained, load_pretrained

__all__ = ["export_run", "merged_run", "MergedRun", "export_rules", "format_report", "ExportError", "ExportReport"]

Flat = dict[tuple[str, ...], Any]
_FULL = precision.Policy("float32", "float32", "float32")


def export_run(run_dir: str | os.PathLike, out_dir: str | os.PathLike, dtype: str, *,
               check_accuracy: bool = False, diagnose: bool = False, overrides: Sequence[str] = ()) -> ExportReport:
    """Exports the newest checkpoint of the run in ``run_dir`` to ``out_dir`` (new or empty) in
    ``dtype`` (``bf16``, ``f16``, ``f32``): adapters merged, float32 kept where the run's rules
    keep it. ``check_accuracy``: also evaluate the exported weights against the float32 ones on
    the run's eval split (:func:`train.inference_report`). ``diagnose``: also run the numerics
    doctor on serving them (:func:`train.diagnose_inference`, one eval batch; written to
    ``OUT/diagnosis.json``). ``overrides``: ``precision.rules=...`` in place of the run's rules
    (a doctor's verified fix). Raises :class:`ExportError` (one line) on bad input; writes
    nothing unless it succeeds."""
    name = export_dtype(dtype)
    run = merged_run(run_dir, overrides)
    out = _free_out(out_dir)
    run_dir, config, step, data, task, model = run.path, run.config, run.step, run.data, run.task, run.model
    sample, params, state, merged, match = run.sample, run.params, run.state, run.merged, run.lora_match
    half = "bfloat16" if name == "int8" else name  # int8: weight-only, the rest (and the compute) bfloat16
    rules = export_rules(config.precision, half)
    exported, kept = _cast(model, sample, params, half, rules, _rules_origin(config.precision))
    if name == "int8":
        exported = int8_weights(params, exported, _contracted(model, sample, params, state))
    checked = {k: np.asarray(dequantize_channels(v, np.float32)) if is_channel_int8(v) else params[k]
               for k, v in exported.items()}  # what serving the export computes with
    served = _served(config, data, model, checked, state, rules) if check_accuracy or diagnose else None
    accuracy = _accuracy(config, data, task, served, half) if check_accuracy else None
    diagnosis = _diagnosis(config, data, served, half, rules) if diagnose else None
    hf = isinstance(model, TokenIds)
    report = ExportReport(out, name, run_dir, step,
                          "huggingface" if hf else "params", (), len(exported),
                          int(sum(np.size(getattr(x, "codes", x)) for x in exported.values())), 0, kept, merged,
                          match, accuracy, _diagnosis_summary(diagnosis, run_dir, name) if diagnosis else None,
                          tuple("/".join(k) for k, v in exported.items() if is_channel_int8(v)))
    with staged(out) as temp:
        tree = {"params": traverse_util.unflatten_dict(channel_arrays(exported)), **_state_f32(state)}
        if hf:
            options = config.model.options
            files = write_huggingface(temp, tree, options["path"], options.get("architecture"))
        else:
            files = [os.path.basename(write_params(temp, tree))]
        size = sum(os.path.getsize(os.path.join(temp, f)) for f in files)  # the weights
        if diagnosis is not None:
            files.append(os.path.basename(write_diagnosis(temp, diagnosis, step or 0, f"export --dtype {name}")))
        files.append(MANIFEST)
        report = report._replace(files=tuple(files), bytes=size)
        write_manifest(temp, report)
    return report


class MergedRun(NamedTuple):
    """A run's newest weights as one float32 model: ``params`` (flat, ``(module, ..., name)``
    keys) with a quantized base read back and LoRA adapters merged; ``state`` its other
    collections; the run's ``config``, ``data``, ``task`` and (unbound) ``model``; ``inputs``
    a batch of the data's inputs (a dict of them passed to the model as ``inputs_as`` says);
    the adapted weights (``merged``) and the merge's check; ``unmerged``: ``params`` before the
    merge (the base read back, the adapters beside it); ``codes``: the base as the checkpoint
    holds it (``{path: QuantizedWeight}``; empty for a run that stores floats)."""

    path: str
    config: Any
    step: int | None
    data: Any
    task: Any
    model: Any
    inputs: Any
    inputs_as: str
    params: Flat
    state: dict
    merged: tuple[str, ...]
    lora_match: float | None
    unmerged: Flat
    codes: dict

    @property
    def sample(self) -> tuple[Any, str]:
        """``(inputs, inputs_as)``: how the model is called on the data."""
        return self.inputs, self.inputs_as


def merged_run(run_dir: str | os.PathLike, overrides: Sequence[str] = ()) -> MergedRun:
    """The newest checkpoint of the run in ``run_dir`` as the float32 weights an export
    writes before casting them (``overrides``: ``precision.rules=...`` only). Raises
    :class:`ExportError` (one line) for what is not a trained run of this framework."""
    run_dir, config, step = _read_run(run_dir, overrides)
    try:
        data, task, model = build_experiment(config, memory=(0, "here"))
        variables, _ = load_pretrained(run_dir)
    except (ConfigError, DataError, PretrainedError) as e:
        raise ExportError(f"{run_dir}: {e}") from None
    inputs = data.train_batch(0, 2, config.seed)["inputs"]
    inputs_as = inputs_as_for(model, inputs, config.data.inputs_as)
    shapes = _param_shapes(bind(model, "fp32"), inputs, inputs_as)
    state = {k: v for k, v in variables.items() if k != "params"}
    stored = traverse_util.flatten_dict(variables["params"])
    codes = stored_codes(stored, shapes)
    unmerged = dequantized_base(stored, shapes, codes)
    params, merged, match = _merge_lora(config, model, (inputs, inputs_as), unmerged, state)
    _check_fits(params, shapes, run_dir)
    return MergedRun(run_dir, config, step, data, task, model, inputs, inputs_as, params, state, merged, match,
                     unmerged, codes)


def _read_run(run_dir: str | os.PathLike, overrides: Sequence[str] = ()) -> tuple[str, Any, int]:
    """``(absolute path, config, newest step)`` of a run's workdir, or :class:`ExportError`;
    ``overrides`` (``precision.rules=...`` only) applied to its config."""
    path = os.path.abspath(os.path.expanduser(os.fspath(run_dir)))
    if not os.path.isdir(path):
        raise ExportError(f"{path} is not a run: it {'is a file' if os.path.exists(path) else 'does not exist'}")
    if not os.path.isfile(os.path.join(path, "config.yaml")):
        raise ExportError(f"{path} is not a run of this framework: it has no config.yaml")
    if not checkpoint_steps(os.path.join(path, "checkpoints")):
        raise ExportError(f"{path} is not a trained run: it has no checkpoints/<step>/state")
    other = [o for o in overrides if o.partition("=")[0].strip() != "precision.rules" or "=" not in o]
    if other:
        raise ExportError(f"export takes only precision.rules=[...] overrides (the rules that keep modules in "
                          f"float32), got {other[0]!r}")
    try:
        config = load_run_config(path, list(overrides))
    except ConfigError as e:
        raise ExportError(str(e)) from None
    return path, config, find_pretrained(path)[2]


def _free_out(out_dir: str | os.PathLike) -> str:
    """The absolute path of ``out_dir``, which must not exist, or be an empty directory."""
    out = os.path.abspath(os.path.expanduser(os.fspath(out_dir)))
    if os.path.exists(out) and not (os.path.isdir(out) and not os.listdir(out)):
        raise ExportError(f"{out} exists and is not empty; give a new directory")
    return out


def _param_shapes(bound: Any, inputs: Any, inputs_as: str) -> dict[tuple[str, ...], tuple[int, ...]]:
    """The model's params and their shapes, from its init traced abstractly on ``inputs``
    (a dict of them passed as ``inputs_as`` says)."""
    key = jax.random.key(0)
    keys = {"params": key, "dropout": key}
    mode = mode_kwargs(bound, False)
    variables = jax.eval_shape(lambda k: call_with(bound.init, inputs, k, inputs_as=inputs_as, **mode), keys)
    return {p: tuple(x.shape) for p, x in traverse_util.flatten_dict(variables["params"]).items()}


def _apply(bound: Any, sample: tuple[Any, str], state: dict) -> Any:
    """``params -> the model's floating outputs`` (a list), in eval mode, on ``sample``:
    ``(inputs, inputs_as)``."""
    mode = mode_kwargs(bound, False)
    inputs, inputs_as = sample

    def apply(params):
        out = call_with(bound.apply, inputs, {"params": params, **state}, inputs_as=inputs_as, **mode)
        return [x.astype(jnp.float32) for x in jax.tree_util.tree_leaves(out) if jnp.issubdtype(x.dtype, jnp.floating)]

    return jax.jit(apply)


def _gradients(apply: Any, params: dict) -> Flat:
    """Gradients of a fixed random projection of the outputs: one backward pass."""
    shapes = jax.eval_shape(apply, params)
    weights = [jax.random.normal(jax.random.key(i), s.shape, jnp.float32) for i, s in enumerate(shapes)]
    grads = jax.jit(jax.grad(lambda p: sum(jnp.vdot(y, w) for y, w in zip(apply(p), weights))))(params)
    return {k: np.asarray(v) for k, v in traverse_util.flatten_dict(grads).items()}


def _contracted(model: Any, sample: tuple[Any, str], params: Flat, state: dict) -> Flat:
    """:func:`precision.contracted_axes` of each param in the model's eval forward pass on ``sample``."""
    tree = traverse_util.unflatten_dict({k: jnp.asarray(v) for k, v in params.items()})
    return traverse_util.flatten_dict(contracted_axes(_apply(bind(model, "fp32"), sample, state), tree,
                                                      lookups=False))


def _merge_lora(config: Any, model: Any, sample: tuple[Any, str], params: Flat, state: dict
                ) -> tuple[Flat, tuple[str, ...], float | None]:
    """``params`` with each adapter pair merged into its weight and dropped, the merged
    weights' paths, and how far the merged model's outputs are from the LoRA model's on
    ``sample``: ``(inputs, inputs_as)``."""
    pairs = adapter_pairs(params)
    if not pairs:
        return params, (), None
    spec = run_lora(config, "merged")
    scale = spec.alpha / spec.rank
    adapted = finetune_model(nnx.clone(model) if isinstance(model, nnx.Module) else model, FineTune(lora=spec),
                             *sample)
    with_adapters = _apply(bind(adapted, "fp32"), sample, state)
    tree = traverse_util.unflatten_dict({k: jnp.asarray(v) for k, v in params.items()})
    grads = _gradients(with_adapters, tree)
    merged = {k: v for k, v in params.items() if not any(k in pair for pair in pairs.values())}
    for weight, (a, b) in pairs.items():
        w, a_value, b_value = (np.asarray(params[k], np.float32) for k in (weight, a, b))
        if not b_value.any():  # untrained (B starts at zero): nothing to add
            continue
        layout = pick_layout(adapter_layouts(w.shape, a_value.shape, b_value.shape), a_value, b_value,
                             (grads[weight], grads[a], grads[b]), scale)
        if layout is None:
            raise ExportError(f"{'/'.join(weight)}: its LoRA adapters cannot be merged: the weight is read by "
                              f"more than the adapted matmul (a tied embedding?), or by none")
        merged[weight] = w + scale * lora_delta(layout, w.shape, a_value, b_value)
    match = _match(with_adapters, _apply(bind(model, "fp32"), sample, state), tree, params, merged, pairs)
    return merged, tuple("/".join(k) for k in pairs), match


def run_lora(config: Any, purpose: str) -> LoRA:
    """The LoRA spec (rank, alpha, targets) a run's checkpoint's adapters were trained with, without
    dropout; :class:`ExportError` if its config has none (the adapters cannot be ``purpose``)."""
    lora = config.finetune.lora
    if lora.rank is None:
        raise ExportError(f"the checkpoint has LoRA adapters and the run's config no finetune.lora section (rank, "
                          f"alpha): they cannot be {purpose}")
    return LoRA(rank=lora.rank, alpha=lora.alpha, targets=tuple(lora.targets), dropout=0.0).checked()


def _match(with_adapters: Any, base: Any, tree: dict, params: Flat, merged: Flat, pairs: dict) -> float:
    """The merged model's largest output difference from the LoRA model's, relative to its
    largest output; an error if it is more than rounding (1% of what the adapters add)."""
    unmerged = {k: v for k, v in params.items() if not any(k in pair for pair in pairs.values())}
    lora, ours, plain = (with_adapters(tree), base(traverse_util.unflatten_dict(merged)),
                         base(traverse_util.unflatten_dict(unmerged)))
    worst = max(float(jnp.max(jnp.abs(x - y))) for x, y in zip(lora, ours))
    effect = max(float(jnp.max(jnp.abs(x - y))) for x, y in zip(lora, plain))
    size = max(float(jnp.max(jnp.abs(x))) for x in lora) or 1.0
    if worst > 1e-2 * effect + 1e-5 * size:
        raise ExportError(f"the merged model's outputs differ from the LoRA model's by {worst:.3g} (the adapters "
                          f"add {effect:.3g}): the adapters cannot be merged exactly")
    return worst / size


def _check_fits(params: Flat, shapes: dict, run_dir: str) -> None:
    """The merged params are the model's, in its shapes (else the checkpoint is another model's)."""
    for path in sorted(set(params) | set(shapes)):
        have, want = np.shape(params[path]) if path in params else None, shapes.get(path)
        if have != want:
            raise ExportError(f"{run_dir}: params/{'/'.join(path)} is {have or 'missing'} in the checkpoint and "
                              f"{want or 'missing'} in the model its config.yaml builds")


def _run_rules(section: Any) -> tuple[Rule, ...]:
    """The run's per-module rules: ``precision.rules``, or its policy's own."""
    return precision.get_rules(section.policy) if section.rules is None else as_rules(section.rules)


def _rules_origin(section: Any) -> str:
    return "precision.rules" if section.rules is not None else f"{section.policy}'s rules"


def export_rules(section: Any, dtype: str) -> tuple[Rule, ...]:
    """The run's rules for the export: a module they keep in float32 stays float32, the rest in ``dtype``."""
    target = precision.Policy(dtype, dtype, "float32")
    return tuple(Rule(r.pattern, _FULL if r.policy.param_dtype == jnp.float32 else target)
                 for r in _run_rules(section))


def _cast(model: Any, sample: tuple[Any, str], params: Flat, dtype: str, rules: tuple[Rule, ...], origin: str
          ) -> tuple[Flat, dict[str, str]]:
    """``params`` cast as the framework casts them under ``params=dtype`` and ``rules``, and the
    params kept in float32 with the rule that keeps each."""
    bound = bind(model, precision.Policy(dtype, dtype, "float32"), rules)
    _param_shapes(bound, *sample)  # records the module structure (class names), abstractly
    abstract = traverse_util.unflatten_dict({k: jax.ShapeDtypeStruct(np.shape(v), np.float32)
                                             for k, v in params.items()})

    def dtypes(model_rules):
        model_ = bound if model_rules is rules else rebind(bound, bound.policy, model_rules)
        cast = jax.eval_shape(lambda p: cast_variables(model_, {"params": p})["params"], abstract)
        return {k: np.dtype(v.dtype) for k, v in traverse_util.flatten_dict(cast).items()}

    plan = dtypes(rules)
    floating = {k for k, v in params.items() if jnp.issubdtype(np.asarray(v).dtype, jnp.floating)}
    exported = {k: np.asarray(v).astype(plan[k]) if k in floating else np.asarray(v) for k, v in params.items()}
    kept = [k for k in floating if plan[k] == np.float32 and dtype != "float32"]
    reasons: dict[str, str] = {}
    for i, rule in enumerate(rules):
        if len(reasons) == len(kept) or rule.policy != _FULL:
            continue
        now = dtypes(rules[:i + 1])
        for k in kept:
            if "/".join(k) not in reasons and now[k] == np.float32:
                reasons["/".join(k)] = f"rule {rule.pattern} -> f32 ({origin})"
    return exported, {"/".join(k): reasons.get("/".join(k), f"a rule ({origin})") for k in sorted(kept)}


def _state_f32(state: dict) -> dict:
    """The model's other collections (BatchNorm statistics) as they were: float32."""
    return jax.tree_util.tree_map(np.asarray, state)


def _served(config: Any, data: Any, model: Any, params: Flat, state: dict, rules: tuple[Rule, ...]) -> Any:
    """A float32 state of the merged weights under the export's rules, to serve as the export casts."""
    variables = {"params": traverse_util.unflatten_dict({k: jnp.asarray(v) for k, v in params.items()}), **state}
    return create_train_state(model, _FULL, optax.identity(), jax.random.key(config.seed), data.sample_input(1),
                              rules=rules, variables=variables, inputs_as=config.data.inputs_as)


def _accuracy(config: Any, data: Any, task: Any, served: Any, dtype: str) -> dict[str, dict[str, float]]:
    """:func:`train.inference_report` of the merged float32 weights, served in float32 and in
    ``dtype`` cast as the export casts them (the same rules), on the run's eval split."""
    batches = lambda: data.eval_batches(config.data.eval_batch_size, config.data.eval_batches)  # noqa: E731
    return inference_report(served, batches, task, () if dtype == "float32" else (dtype,))


def _diagnosis(config: Any, data: Any, served: Any, dtype: str, rules: tuple[Rule, ...]) -> precision.Diagnosis:
    """The doctor on serving the weights in ``dtype`` under the export's rules: the eval forward
    pass on the run's first eval batch."""
    batch = next(iter(data.eval_batches(config.data.eval_batch_size, 1)))
    return diagnose_inference(served, batch, dtype, rules=rules)


def _diagnosis_summary(diagnosis: precision.Diagnosis, run_dir: str, dtype: str) -> dict[str, Any]:
    fix = next((r for r in diagnosis.recommendations if r.overrides), None)
    again = (f"python -m train export {run_dir} --dtype {dtype} OUT {fix.command_line}" if fix else None)
    return {"healthy": diagnosis.healthy, "summary": summary_line(diagnosis), "export_again": again}


def format_report(report: ExportReport) -> str:
    """The export's summary: one line per fact."""
    lines = [f"exported: {report.params} params ({report.values:,} values) in {report.dtype}, from step "
             f"{report.step} of {report.source}"]
    if report.merged:
        lines.append(f"merged: {len(report.merged)} LoRA adapter pairs into their weights ({_first(report.merged)}); "
                     f"the merged model's outputs match the LoRA model's to {report.lora_match:.1e} "
                     f"(float32, relative)")
    by_reason: dict[str, list[str]] = {}
    for path, reason in report.kept_float32.items():
        by_reason.setdefault(reason, []).append(path)
    for reason, paths in by_reason.items():
        lines.append(f"kept in float32: {len(paths)} params ({_first(paths)}): {reason}")
    if report.int8:
        lines.append(f"int8: {len(report.int8)} weights as int8 codes with a float32 scale per output channel "
                     f"({_first(report.int8)}); the other params in bfloat16 but those kept in float32")
    kind = "a Hugging Face directory" if report.format == "huggingface" else "weights"
    lines.append(f"written: {format_bytes(report.bytes)} in {report.out}: {kind} ({', '.join(report.files)}); "
                 f"model.init_from={report.out} reads it")
    if report.accuracy:
        lines.append(_accuracy_line(report.accuracy))
    if report.diagnosis:
        lines.append(f"doctor, serving in {report.dtype} (one eval batch; diagnosis.json): "
                     f"{report.diagnosis['summary']}")
        if report.diagnosis.get("export_again"):
            lines.append(f"to export with the fix: {report.diagnosis['export_again']}")
    return "\n".join(lines)


def _accuracy_line(accuracy: dict[str, dict[str, float]]) -> str:
    metric = "accuracy" if all("accuracy" in m for m in accuracy.values()) else "loss"
    values = ", ".join(f"{dtype} {m[metric]:.4f}" for dtype, m in accuracy.items())
    deltas = [f"{m[metric] - accuracy['float32'][metric]:+.4f}" for d, m in accuracy.items() if d != "float32"]
    return f"{metric} on the eval split: {values}" + (f" (change {', '.join(deltas)})" if deltas else "")


def _first(names: Any, limit: int = 4) -> str:
    names = list(names)
    return ", ".join(names[:limit]) + (f", ... ({len(names)} in all)" if len(names) > limit else "")
