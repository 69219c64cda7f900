"""The benchmark suite: every model under every policy, and the three headline ratios.

Per model and policy it compiles :func:`train.make_train_step` (the step users
train with) and a forward-only loss, then measures step and forward time,
throughput, activation bytes saved for the backward pass, XLA's memory plan
and FLOPs, the half-precision share of matmul/conv FLOPs, and MFU on GPUs.

Headline ratios (each the worst over the models measured):
  ``overhead_ratio``             our train_step / a hand-written JAX + optax step
                                 doing the same casts and optimizer (mixed_bf16);
  ``loss_scale_overhead_ratio``  mixed_f16 with dynamic loss scaling / without;
  ``memory_ratio``               GPT activation bytes, mixed_bf16 / fp32 (always
                                 at the ``full`` GPT batch: it is traced, not run).

Programs repeat: a ``_pinned`` twin compiles to its unpinned model's programs
(autocast traces both in float32; :func:`program_id` tells). With the persistent
compilation cache that ``python -m benchmarks`` turns on
(:mod:`train.experiment.compile_cache`) they load instead of compiling, and the two
overhead ratios, which would time the very same programs again, are reused
(marked ``same_programs_as``).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import hashlib
import json
import os
import pathlib
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax

import train
from benchmarks import hlo, measure
from benchmarks.workloads import MODELS, POLICIES, PolicyCase, Workload, model_flops_per_step, policy_case, workload


@dataclasses.dataclass(frozen=True)
class Settings:
    """How long to measure: steps per median, alternating rounds and steps per round."""

    size: str = "full"
    steps: int = 20
    warmup: int = 2
    rounds: int = 10
    steps_per_round: int = 3
    models: tuple[str, ...] = MODELS
    policies: tuple[str, ...] = tuple(p.name for p in POLICIES)
    compile_threads: int = min(os.cpu_count() or 1, 8)
    programs: str | None = None  # a directory to write each compiled step's optimized HLO to
    partial: str | None = None  # a JSON file rewritten with the results so far after each row and ratio


def _save_program(settings: Settings, name: str, compiled: Any) -> None:
    """Writes ``compiled``'s optimized HLO to ``<settings.programs>/<name>.hlo`` (when asked):
    the very program the device ran, for fitting :mod:`train.inspections.gpu_time` on it."""
    if settings.programs:
        directory = pathlib.Path(settings.programs)
        directory.mkdir(parents=True, exist_ok=True)
        (directory / f"{name}.hlo").write_text(compiled.as_text())


def _write_partial(settings: Settings, rows: list, overheads: list, scale_overheads: list) -> None:
    """The results so far, to ``settings.partial`` (when asked): a run stopped at a time limit
    (a GPU lease's phase) keeps what it measured."""
    if settings.partial:
        path = pathlib.Path(settings.partial)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"rows": rows, "overhead": overheads, "loss_scale_overhead": scale_overheads},
                                   indent=1, default=str) + "\n")


def _optimizer() -> optax.GradientTransformation:
    return optax.adamw(1e-3, weight_decay=1e-4)


def _precision(case: PolicyCase | None):
    if case is None or case.matmul_precision is None:
        return contextlib.nullcontext()
    return jax.default_matmul_precision(case.matmul_precision)


def initial_variables(w: Workload) -> dict[str, Any]:
    """The model's float32 variables at init: every policy starts from these."""
    state = train.create_train_state(w.model, "fp32", _optimizer(), jax.random.key(0), _sample(w))
    return {"params": state.params, **state.model_state}


def _sample(w: Workload) -> jax.Array:
    return jnp.zeros((1,) + w.inputs.shape[1:], w.inputs.dtype)


def _state(w: Workload, policy: str, loss_scale: str, rules: Any, variables: Any,
           skip_with: str = "auto") -> train.TrainState:
    variables = jax.tree_util.tree_map(jnp.copy, variables)  # a step donates its state's buffers
    return train.create_train_state(w.model, policy, _optimizer(), jax.random.key(0), _sample(w), rules=rules,
                                    loss_scale=loss_scale, variables=variables, skip_with=skip_with)


def _loss(state: train.TrainState, params: Any, batch: dict) -> jax.Array:
    """The train step's forward pass and loss (train mode, float32 cross-entropy)."""
    mutable = list(state.model_state)
    out = state.model.apply({"params": params, **state.model_state}, batch["inputs"], train=True,
                            mutable=mutable or False, rngs={"dropout": jax.random.key(0)})
    logits = out[0] if mutable else out
    return train.cross_entropy(logits, batch["labels"])[0].mean()


@dataclasses.dataclass
class Prepared:
    """A compiled case, ready to time: state, batch, train step and forward pass."""

    state: Any
    batch: dict
    step: Any
    forward: Any = None
    lowered: Any = None
    residuals: Any = None
    compile_seconds: float = 0.0
    program: str = ""  # program_id of the step: equal ids, equal compiled programs


def _compile(fn: Callable, *args: Any, case: PolicyCase | None = None) -> tuple[Any, Any, float]:
    start = time.perf_counter()
    with _precision(case):
        lowered = fn.lower(*args)
        return lowered, lowered.compile(), time.perf_counter() - start


def program_id(lowered: Any) -> str:
    """A fingerprint of a lowered program without its source locations (what JAX's
    persistent compilation cache keys on, less the compile options): a ``_pinned``
    twin's programs have its unpinned model's ids."""
    text = lowered.compiler_ir().operation.get_asm(enable_debug_info=False)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def prepare_case(w: Workload, case: PolicyCase, variables: Any) -> Prepared:
    """Builds and compiles ``w`` under ``case``; traces its saved residuals."""
    state, batch = _state(w, case.policy, case.loss_scale, w.rules, variables), w.batch()
    lowered, step, seconds = _compile(train.make_train_step(donate=True), state, batch, case=case)
    _, forward, _ = _compile(jax.jit(lambda s, b: _loss(s, s.params, b)), state, batch, case=case)
    with _precision(case):
        residuals = measure.saved_residuals(functools.partial(_loss, state), state.params, batch)
    return Prepared(state, batch, step, forward, lowered, residuals, seconds, program_id(lowered))


def measure_case(w: Workload, case: PolicyCase, settings: Settings, prepared: Prepared
                 ) -> tuple[dict[str, Any], Any]:
    """One row: times, throughput, activations, memory and FLOPs of ``w`` under ``case``.

    Also returns the state trained on, for reuse with ``prepared.step``.
    """
    batch, step, forward = prepared.batch, prepared.step, prepared.forward

    def run_forward(s):
        jax.block_until_ready(forward(s, batch))
        return s

    fwd_s, state = measure.median_seconds(run_forward, prepared.state, settings.steps, settings.warmup)
    step_s, state = measure.median_seconds(lambda s: step(s, batch)[0], state, settings.steps, settings.warmup)
    pipelined_s, state = measure.back_to_back_seconds(lambda s: step(s, batch)[0], state, settings.steps)
    program = hlo.matmul_flops(prepared.lowered.as_text(dialect="hlo"))
    compiled = hlo.matmul_flops(step.as_text())
    items = w.batch_size * w.tokens_per_example
    math = "half" if program.half_share > 0.5 else ("f32" if case.matmul_precision == "highest" else "tf32")
    peak = measure.peak_flops(jax.devices()[0], math)
    model_flops = model_flops_per_step(w)
    row = {
        "model": w.name, "policy": case.name, "policy_spec": case.policy, "loss_scale": case.loss_scale,
        "matmul_precision": case.matmul_precision or "default",
        "step_seconds": step_s, "step_seconds_back_to_back": pipelined_s, "forward_seconds": fwd_s, "backward_seconds": step_s - fwd_s,
        "items_per_second": items / step_s, "items": "tokens" if w.tokens_per_example > 1 else "examples",
        "activations": measure.activation_bytes(prepared.residuals),
        "memory": measure.compiled_memory(step),
        "xla_flops": measure.compiled_flops(step),
        "xla_bytes_accessed": measure.compiled_bytes_accessed(step),
        "matmul_flops": program.total,
        "half_matmul_share_program": program.half_share,
        "half_matmul_share_compiled": compiled.half_share,
        "mfu": program.total / step_s / peak if peak else None,
        "model_flops": model_flops,
        "mfu_model_flops": model_flops / pipelined_s / peak if peak and model_flops else None,
        "peak_flops": peak,
        "modeled": measure.modeled_step(step.as_text(), jax.devices()[0]),
        "compile_seconds": prepared.compile_seconds,
    }
    return row, state


def _hand_written_step(w: Workload, compute_dtype: Any, params: Any, model_state: Any) -> tuple[Callable, Any]:
    """The step a user writes without this library: cast params and inputs to
    ``compute_dtype``, float32 loss, grad, optax update. Returns it and its
    state, starting from copies of float32 ``params`` and ``model_state``."""
    model, tx = w.model, _optimizer()
    if getattr(model, "dtype", None) is not None:  # a pinned model: written in the half dtype instead
        model = model.clone(dtype=compute_dtype)
    params, model_state = jax.tree_util.tree_map(jnp.copy, (params, model_state))

    def cast(tree):
        return jax.tree_util.tree_map(
            lambda x: x.astype(compute_dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)

    def step(carry, batch):
        params, opt_state, model_state = carry

        def loss_fn(p):
            out, new_state = model.apply({"params": cast(p), **model_state}, cast(batch["inputs"]), train=True,
                                         mutable=list(model_state), rngs={"dropout": jax.random.key(0)})
            logits = out.astype(jnp.float32)
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"]).mean(), new_state

        (loss, new_state), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state, new_state), loss

    return jax.jit(step, donate_argnums=(0,)), (params, tx.init(params), model_state)


def prepare_overhead(w: Workload, variables: Any, skip_with: str = "auto") -> tuple[Prepared, Prepared]:
    """Our train_step (mixed_bf16, no per-module rules) and the hand-written step, compiled."""
    ours, batch = _state(w, "mixed_bf16", "none", (), variables, skip_with), w.batch()
    hand_jit, hand = _hand_written_step(w, jnp.bfloat16, ours.params, ours.model_state)
    ours_lowered, ours_step, _ = _compile(train.make_train_step(donate=True), ours, batch)
    hand_lowered, hand_step, _ = _compile(hand_jit, hand, batch)
    return (Prepared(ours, batch, ours_step, lowered=ours_lowered, program=program_id(ours_lowered)),
            Prepared(hand, batch, hand_step, lowered=hand_lowered, program=program_id(hand_lowered)))


def overhead(w: Workload, settings: Settings, prepared: tuple[Prepared, Prepared]) -> dict[str, Any]:
    """Our train_step vs the hand-written step, same model, casts (mixed_bf16,
    no per-module rules) and optimizer, timed alternately."""
    ours, hand = prepared
    batch = ours.batch
    # Same computation? One step from the same params must give the same loss.
    (ours_state, metrics), (hand_state, hand_loss) = ours.step(ours.state, batch), hand.step(hand.state, batch)
    same_loss = abs(float(metrics["loss"]) - float(hand_loss))
    timing = measure.alternating_ratio(lambda c: hand.step(c, batch)[0], hand_state,
                                       lambda s: ours.step(s, batch)[0], ours_state,
                                       settings.rounds, settings.steps_per_round, settings.warmup)
    # Each on its own too, a longer run back to back (as training runs it) and steps waited for one by one.
    hand_b2b, hand_state = measure.back_to_back_seconds(lambda c: hand.step(c, batch)[0], timing["a_carry"], settings.steps)
    ours_b2b, ours_state = measure.back_to_back_seconds(lambda s: ours.step(s, batch)[0], timing["b_carry"], settings.steps)
    hand_waited, _ = measure.median_seconds(lambda c: hand.step(c, batch)[0], hand_state, settings.steps)
    ours_waited, _ = measure.median_seconds(lambda s: ours.step(s, batch)[0], ours_state, settings.steps)
    device = jax.devices()[0]
    return {"model": w.name, "ratio": timing["ratio"], "ours_seconds": timing["b_seconds"],
            "hand_written_seconds": timing["a_seconds"], "ratios": timing["ratios"],
            "ours_back_to_back_seconds": ours_b2b, "hand_written_back_to_back_seconds": hand_b2b,
            "back_to_back_ratio": ours_b2b / hand_b2b,
            "ours_waited_seconds": ours_waited, "hand_written_waited_seconds": hand_waited,
            "waited_ratio": ours_waited / hand_waited,
            "first_step_loss_difference": same_loss,
            "ours_modeled": measure.modeled_step(ours.step.as_text(), device),
            "hand_written_modeled": measure.modeled_step(hand.step.as_text(), device)}


def prepare_unscaled(w: Workload, variables: Any) -> Prepared:
    """mixed_f16 without loss scaling, compiled (the dynamic case is a row of the table)."""
    state, batch = _state(w, "mixed_f16", "none", w.rules, variables), w.batch()
    lowered, step, _ = _compile(train.make_train_step(donate=True), state, batch)
    return Prepared(state, batch, step, program=program_id(lowered))


def loss_scale_overhead(w: Workload, settings: Settings, unscaled: Prepared, scaled: Prepared) -> dict[str, Any]:
    """mixed_f16 with dynamic loss scaling (``scaled``) vs without, timed alternately."""
    batch = unscaled.batch
    timing = measure.alternating_ratio(lambda s: unscaled.step(s, batch)[0], unscaled.state,
                                       lambda s: scaled.step(s, batch)[0], scaled.state,
                                       settings.rounds, settings.steps_per_round, settings.warmup)
    return {"model": w.name, "ratio": timing["ratio"], "dynamic_seconds": timing["b_seconds"],
            "none_seconds": timing["a_seconds"], "ratios": timing["ratios"]}


SHIPPED_GPT_RULES = (("LayerNorm", "f32"), ("Softmax", "f32"))  # configs/shakespeare_gpt_*.yaml


def memory(size: str = "full") -> dict[str, Any]:
    """GPT activation bytes saved for the backward pass, mixed_bf16 vs fp32.

    Traced only, never run, so it is measured at the ``full`` batch even in a
    quick run. ``ratio`` uses the preset's rules (norms in float32);
    ``ratio_f32_softmax`` the shipped config's rules, which also keep the
    attention softmax in float32.
    """
    w = workload("gpt", "full" if size == "quick" else size)
    batch = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), w.batch())
    out: dict[str, Any] = {"batch": w.batch_size, "seq_len": w.tokens_per_example}
    variables = initial_variables(w)
    for key, name, rules in (("fp32", "fp32", None), ("mixed_bf16", "mixed_bf16", None),
                             ("mixed_bf16_f32_softmax", "mixed_bf16", SHIPPED_GPT_RULES)):
        case = policy_case(name)
        state = _state(w, case.policy, case.loss_scale, rules, variables)
        out[key] = measure.activation_bytes(
            measure.saved_residuals(functools.partial(_loss, state), state.params, batch))
    out["ratio"] = out["mixed_bf16"]["bytes"] / out["fp32"]["bytes"]
    out["ratio_f32_softmax"] = out["mixed_bf16_f32_softmax"]["bytes"] / out["fp32"]["bytes"]
    return out


def run(settings: Settings, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Runs the suite; returns ``{"rows", "overhead", "loss_scale_overhead", "memory", ...}``.

    Per model, every program is compiled first, ``settings.compile_threads`` at a
    time (XLA compiles outside the GIL), then timed one at a time.
    """
    rows, overheads, scale_overheads = [], [], []
    timed: dict[tuple[str, ...], dict[str, Any]] = {}  # ratios by the programs they time
    for name in settings.models:
        w = workload(name, settings.size)
        log(f"[{name}] {w.describe()}")
        start = time.perf_counter()
        variables = initial_variables(w)
        with concurrent.futures.ThreadPoolExecutor(settings.compile_threads) as pool:
            cases = {p: pool.submit(prepare_case, w, policy_case(p), variables) for p in settings.policies}
            over = pool.submit(prepare_overhead, w, variables)
            unscaled = pool.submit(prepare_unscaled, w, variables)
            cases = {p: _compiled_or_none(f, p, log) for p, f in cases.items()}
            cases = {p: c for p, c in cases.items() if c is not None}
            over, unscaled = over.result(), unscaled.result()
        log(f"  compiled {2 * len(cases) + 3} programs in {time.perf_counter() - start:.1f} s")
        for policy, prepared in cases.items():
            case = policy_case(policy)
            _save_program(settings, f"{name}-{case.policy}-{case.loss_scale}-{'norules' if w.rules == () else 'rules'}",
                          prepared.step)
        _save_program(settings, f"{name}-mixed_bf16-none-norules", over[0].step)
        _save_program(settings, f"hand_written-{name}", over[1].step)
        _save_program(settings, f"{name}-mixed_f16-none-rules", unscaled.step)
        for policy, prepared in cases.items():
            row, prepared.state = measure_case(w, policy_case(policy), settings, prepared)
            rows.append(row)
            _write_partial(settings, rows, overheads, scale_overheads)
            log(f"  {policy:13s} step {row['step_seconds'] * 1e3:9.2f} ms  fwd {row['forward_seconds'] * 1e3:9.2f} ms"
                f"  {row['items_per_second']:12.0f} {row['items']}/s  activations "
                f"{row['activations']['bytes'] / 2 ** 20:8.2f} MiB")
        overheads.append(_once(timed, ("overhead", over[0].program, over[1].program), name,
                               functools.partial(overhead, w, settings, over)))
        _write_partial(settings, rows, overheads, scale_overheads)
        scaled = cases.get("mixed_f16")
        if scaled is None:
            scaled = prepare_case(w, policy_case("mixed_f16"), variables)
            _save_program(settings, f"{name}-mixed_f16-dynamic-{'norules' if w.rules == () else 'rules'}", scaled.step)
        scale_overheads.append(_once(timed, ("loss_scale", unscaled.program, scaled.program), name,
                                     functools.partial(loss_scale_overhead, w, settings, unscaled, scaled)))
        _write_partial(settings, rows, overheads, scale_overheads)
        log(f"  train_step / hand-written {overheads[-1]['ratio']:.3f}, dynamic / no loss scale "
            f"{scale_overheads[-1]['ratio']:.3f}  ({time.perf_counter() - start:.1f} s for {name})")
        del cases, over, unscaled, scaled
    _relative_to_fp32(rows)
    start = time.perf_counter()
    mem = memory(settings.size)
    log(f"[memory] GPT activations traced at batch {mem['batch']}: mixed_bf16 / fp32 = {mem['ratio']:.3f} "
        f"({time.perf_counter() - start:.1f} s)")
    return {
        "rows": rows, "overhead": overheads, "loss_scale_overhead": scale_overheads, "memory": mem,
        "overhead_ratio": max(o["ratio"] for o in overheads),
        "loss_scale_overhead_ratio": max(o["ratio"] for o in scale_overheads),
        "memory_ratio": mem["ratio"],
    }


def _compiled_or_none(future: concurrent.futures.Future, policy: str, log: Callable[[str], None]) -> Prepared | None:
    """A case's compiled programs, or None (said in one line) where the backend cannot build them:
    one policy failing leaves the others their rows."""
    try:
        return future.result()
    except Exception as err:  # noqa: BLE001 - reported, and the rest of the suite goes on
        log(f"  {policy}: not measured, compiling failed: {type(err).__name__}: {str(err).splitlines()[0][:300]}")
        return None


def _once(timed: dict, programs: tuple[str, ...], model: str, measure_ratio: Callable[[], dict]) -> dict:
    """``measure_ratio()``, unless the same two programs were timed already for another
    model (a ``_pinned`` twin of one measured): then that result, marked as such."""
    if programs in timed:
        return {**timed[programs], "model": model, "same_programs_as": timed[programs]["model"]}
    timed[programs] = result = measure_ratio()
    return result


def _relative_to_fp32(rows: list[dict]) -> None:
    unpinned = {(r["model"], r["policy"]): r for r in rows}
    for r in rows:  # the pinned-dtype twin compiles to the same program (up to casts)
        twin = unpinned.get((r["model"].removesuffix("_pinned"), r["policy"])) if r["model"].endswith("_pinned") else None
        r["pinned_flops_vs_unpinned"] = _ratio(r["xla_flops"], twin and twin["xla_flops"])
        r["pinned_bytes_vs_unpinned"] = _ratio(r["xla_bytes_accessed"], twin and twin["xla_bytes_accessed"])
    base = {r["model"]: r for r in rows if r["policy"] == "fp32"}
    for r in rows:
        b = base.get(r["model"])
        r["speedup_vs_fp32"] = b["step_seconds"] / r["step_seconds"] if b else None
        r["activations_vs_fp32"] = r["activations"]["bytes"] / b["activations"]["bytes"] if b else None
        total, b_total = r["memory"].get("total"), b["memory"].get("total") if b else None
        r["memory_total_vs_fp32"] = total / b_total if total and b_total else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None
