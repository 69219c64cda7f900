"""The modeled TPU v5e step of ``mixed_int8`` against ``mixed_bf16``, and the best any int8 program could do.

Each case is the GPT train step of ``configs/gpu/gpt2_small_mixed_bf16.yaml`` with overrides
(or of a user's GPT on Flax's own attention, ``examples/user_models/linen_gpt.yaml``, at the same shape),
compiled for one v5e by libtpu's compile-only client (no TPU here:
:func:`train.inspections.compile_for.compile_for`) under both policies, and modeled
(:mod:`train.inspections.tpu_time`: each op the longest of its HBM time, its matrix time at the
datasheet's peak and XLA's own estimate of it; **a model, never a measurement**). For each:

- the modeled step of both policies and their ratio (the issue's goal: at most 0.8);
- the **Amdahl bound**: the bf16 step with every matmul (attention's aside) at twice the rate and
  everything else unchanged (:func:`train.inspections.tpu_time.amdahl_bound`): no int8 program,
  however its quantization is fused, models below it; the same from the two rooflines alone;
- where the time goes, by module kind (the head, the blocks' projections, MLP, attention, the rest).

Under ``mixed_int8`` the matmuls of a one-TPU program are the Pallas kernels of
:mod:`precision.autocast.scaled.int8_pallas` (quantization in VMEM), modeled from their
``cost_estimate`` (a roofline: their vector work is not in the model).

A depth's step is extrapolated from two compiled depths (``L2``, ``L4``: the per-layer time is
their difference over the layers between them, the rest is fixed: embedding, head, loss,
optimizer), so a 24-layer 1.3B GPT is judged without compiling 24 layers.

    python -m benchmarks.int8_tpu_step [--cases gpt2-small,gpt-1.3b-L2,gpt-1.3b-L4] [--cache DIR] [--out DIR]

``--cache DIR`` keeps each compiled program (``CASE-POLICY.txt`` and its memory plan in ``.json``) and
reads it back instead of compiling again (a GPT-2-small compile takes 10-30 minutes on two cores).
Needs libtpu (``pip install '.[tpu-compile]'``; ``JAX_PLATFORMS=cpu``). Writes ``int8-tpu-step.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re
from collections import defaultdict
from typing import Any

from benchmarks.report import RESULTS, command, environment, write_tables
from train.inspections.tpu_time import TpuOpTime, amdahl_bound, model_tpu_step, op_times

CONFIG = pathlib.Path(__file__).resolve().parent.parent / "configs" / "gpu" / "gpt2_small_mixed_bf16.yaml"
_D2048 = ("model.d_model=2048", "model.num_heads=16", "data.seq_len=2048", "data.batch_size=8",
          "data.eval_batch_size=8")
#: d_model 4096 at 8 x 2048 tokens needs 16.5 GiB of temporaries, more than a v5e's 16: 2 x 2048 tokens
_D4096 = ("model.d_model=4096", "model.num_heads=32", "data.seq_len=2048", "data.batch_size=2",
          "data.eval_batch_size=2")
#: case -> (overrides of its config, the GPT-2-small one unless CONFIG_OF names another; layers it has)
CASES = {"gpt2-small": ((), 12),
         "gpt-1.3b-L1": (("model.num_layers=1", *_D2048), 1),
         "gpt-1.3b-L2": (("model.num_layers=2", *_D2048), 2),
         "gpt-d4096-L1": (("model.num_layers=1", *_D4096), 1),
         "gpt-d4096-L2": (("model.num_layers=2", *_D4096), 2)}
#: Flax's own attention (``nn.SelfAttention``: DenseGeneral projections, the output one over heads and head
#: features) in a user's GPT (examples/user_models/linen_gpt.py) at GPT-2 small's shape
LINEN_GPT = CONFIG.parent.parent.parent / "examples" / "user_models" / "linen_gpt.yaml"
_LINEN_GPT2_SMALL = ("model.width=768", "model.heads=12", "model.layers=12", "model.max_len=1024", "data.seq_len=1024",
                     "data.batch_size=16", "data.num_classes=50304", "data.num_test=65536")
CASES["flax-attention-gpt2-small"] = (_LINEN_GPT2_SMALL, 12)
#: the same with its head tied to the embedding as an einsum (x . embeddingᵀ: benchmarks/einsum_head_gpt.py)
CASES["flax-attention-einsum-head"] = (("model.name=benchmarks.einsum_head_gpt:GPT", *_LINEN_GPT2_SMALL), 12)
#: the config of a case that is not the GPT-2-small config with overrides
CONFIG_OF = {"flax-attention-gpt2-small": LINEN_GPT, "flax-attention-einsum-head": LINEN_GPT}
#: depth extrapolations: name -> (the two cases, the depth judged)
EXTRAPOLATIONS = {"gpt-1.3b (d 2048, 24 layers, from L1 and L2)": (("gpt-1.3b-L1", "gpt-1.3b-L2"), 24),
                  "gpt d 4096 (Llama-7B's width, 32 layers, from L1 and L2)": (("gpt-d4096-L1", "gpt-d4096-L2"), 32)}
POLICIES = ("mixed_bf16", "mixed_int8")
#: module kinds of the breakdown, by the first pattern their module path matches
KINDS = (("head", r"^head|^\w+,\w+->\w+$"), ("qkv", r"attn/(qkv|query|key|value)"),
         ("attention proj", r"attn/(proj|out)"), ("MLP in", r"Dense_0|/up(/|$)"), ("MLP out", r"Dense_1|/down(/|$)"),
         ("attention", r"attn"), ("norms", r"LayerNorm|ln_f|/ln\d"), ("rest", r""))


def compiled_text(case: str, policy: str, cache: pathlib.Path | None) -> tuple[str, dict[str, Any]]:
    """The optimized v5e program of ``case`` under ``policy`` and its memory plan: from ``cache`` when
    there, else compiled (and kept there)."""
    overrides = ["workdir=runs/int8_tpu_step", f"precision.policy={policy}", *CASES[case][0]]
    if cache is not None and (cache / f"{case}-{policy}.txt").exists():
        plan = json.loads((cache / f"{case}-{policy}.json").read_text())
        if plan.get("overrides", overrides) == overrides:  # a case since redefined is compiled again
            return (cache / f"{case}-{policy}.txt").read_text(), plan
    from train.config import load_config
    from train.inspections.compile_for import compile_for

    step = compile_for(load_config(CONFIG_OF.get(case, CONFIG), overrides), "v5e")
    plan = {"memory": step.memory, "seconds": step.seconds, "experiment": step.experiment, "overrides": overrides}
    if cache is not None:
        cache.mkdir(parents=True, exist_ok=True)
        (cache / f"{case}-{policy}.txt").write_text(step.hlo_text)
        (cache / f"{case}-{policy}.json").write_text(json.dumps(plan))
    return step.hlo_text, plan


def _kind(op: TpuOpTime) -> str:
    """The module kind (:data:`KINDS`) of an op's module path."""
    return next(name for name, pattern in KINDS if re.search(pattern, op.kernel.module))


def by_kind(ops: list[TpuOpTime]) -> dict[str, float]:
    """Modeled seconds of the step (its :func:`op_times`) by module kind (:data:`KINDS`)."""
    out: dict[str, float] = defaultdict(float)
    for op in ops:
        out[_kind(op)] += op.seconds
    return dict(out)


def by_op(ops: list[TpuOpTime]) -> dict[str, float]:
    """Modeled seconds of the step (its :func:`op_times`) by module kind, op kind and op name (numbers
    stripped: the 12 layers' ``copy_add_fusion.N`` are one entry), so two policies' programs can be
    set side by side."""
    out: dict[str, float] = defaultdict(float)
    for op in ops:
        out[f"{_kind(op)} / {op.kernel.kind} {re.sub(r'[.0-9]+$', '', op.kernel.name)}"] += op.seconds
    return dict(out)


def differences(bf16: dict[str, float], int8: dict[str, float], top: int = 10) -> list[tuple[str, float, float]]:
    """The ``top`` entries of :func:`by_op` where the int8 program's modeled time differs most from the
    bf16 program's, either way: (entry, bf16 seconds, int8 seconds)."""
    keys = set(bf16) | set(int8)
    ranked = sorted(keys, key=lambda k: -abs(int8.get(k, 0.0) - bf16.get(k, 0.0)))
    return [(k, bf16.get(k, 0.0), int8.get(k, 0.0)) for k in ranked[:top]]


def in_blocks(ops: list[TpuOpTime]) -> float:
    """Modeled seconds of the ops (:func:`op_times`) a layer's module path names (``block_N``): the
    layers' share of the step."""
    return sum(op.seconds for op in ops if re.search(r"block_\d+", op.kernel.module))


def case_row(case: str, cache: pathlib.Path | None) -> dict[str, Any]:
    """Both policies' modeled steps of one case, the bf16 step's Amdahl bound, the breakdown."""
    row: dict[str, Any] = {"case": case, "layers": CASES[case][1], "overrides": list(CASES[case][0])}
    ops_by_name = {}
    for policy in POLICIES:
        text, plan = compiled_text(case, policy, cache)
        ops = op_times(text, "v5e")  # read once: the program is megabytes of text
        ops_by_name[policy] = by_op(ops)
        modeled = model_tpu_step(text, "v5e")
        row[policy] = {"modeled": modeled.to_json(), "roofline_seconds": model_tpu_step(text, "v5e",
                                                                                         xla_estimates=False).seconds,
                       "peak_bytes": plan["memory"]["peak"], "by_kind": by_kind(ops),
                       "per_layer": in_blocks(ops) / row["layers"]}
        if policy == "mixed_bf16":
            row["amdahl"], row["amdahl_roofline"] = amdahl_bound(text, "v5e"), amdahl_bound(text, "v5e", False)
            faster = in_blocks(op_times(text, "v5e", matmul_speedup=2.0))
            row["amdahl_per_layer"] = faster / row["layers"] / row[policy]["per_layer"]
    row["ratio"] = row["mixed_int8"]["modeled"]["seconds"] / row["mixed_bf16"]["modeled"]["seconds"]
    row["differences"] = differences(ops_by_name["mixed_bf16"], ops_by_name["mixed_int8"])
    print(f"{case}: bf16 {row['mixed_bf16']['modeled']['seconds'] * 1e3:.1f} ms, int8 "
          f"{row['mixed_int8']['modeled']['seconds'] * 1e3:.1f} ms ({row['ratio']:.3f}x), Amdahl bound "
          f"{row['amdahl']:.3f}", flush=True)
    return row


def extrapolated(rows: dict[str, dict[str, Any]], cases: tuple[str, str], layers: int) -> dict[str, Any]:
    """Each policy's step (and the bf16 step's with matmuls twice as fast) at ``layers``, from two depths."""
    low, high = rows[cases[0]], rows[cases[1]]
    span = high["layers"] - low["layers"]
    out: dict[str, Any] = {"layers": layers, "from": list(cases)}
    for policy in POLICIES:
        a, b = low[policy]["modeled"]["seconds"], high[policy]["modeled"]["seconds"]
        per_layer = (b - a) / span
        out[policy] = {"per_layer": per_layer, "fixed": a - per_layer * low["layers"],
                       "seconds": a + per_layer * (layers - low["layers"])}
    bound_a, bound_b = (r["amdahl"] * r["mixed_bf16"]["modeled"]["seconds"] for r in (low, high))
    bf16 = out["mixed_bf16"]["seconds"]
    out["amdahl"] = (bound_a + (bound_b - bound_a) / span * (layers - low["layers"])) / bf16
    out["ratio"] = out["mixed_int8"]["seconds"] / bf16
    out["per_layer_ratio"] = out["mixed_int8"]["per_layer"] / out["mixed_bf16"]["per_layer"]
    return out


def _tokens(overrides: list[str]) -> str:
    """``batch x sequence`` of a case, the GPT-2-small config's 16 x 1024 unless overridden."""
    given = dict(o.split("=", 1) for o in overrides)
    return f"{given.get('data.batch_size', '16')} x {given.get('data.seq_len', '1024')}"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f}"


def markdown(result: dict[str, Any]) -> str:
    """The tables: each case's modeled steps, ratio and bound; the extrapolations; the breakdowns."""
    lines = ["# The modeled v5e step of `mixed_int8` against `mixed_bf16`, and the Amdahl bound", "",
             "Modeled (`train.inspections.tpu_time`): each op of the compiled program takes the longest of its HBM "
             "time, its matrix time at the datasheet's peak and XLA's own estimate of it; **a model, never a "
             "measurement**. Amdahl bound: the bf16 step with every matmul (attention's aside) at twice the rate, "
             "nothing else changed: no int8 program that leaves the rest as it is models below it. Roofline: the same "
             "without XLA's estimates "
             "(an op kept in VMEM then takes no time). The goal: int8 at most 0.8x bf16. On one TPU the int8 matmuls "
             "are Pallas kernels that quantize their 16-bit operand in VMEM (`precision.autocast.scaled.int8_pallas`): "
             "each is modeled as a roofline from the FLOPs and HBM bytes its `cost_estimate` declares (XLA writes no "
             "estimate of a custom call), so the vector work of its quantization is not in the model (what that leaves "
             "out: `int8-vector-work.md`; it is what lets a layer model below its bound).", "",
             "| case | tokens | bf16 ms | int8 ms | int8 / bf16 | Amdahl bound | roofline: bf16 ms | int8 ms | bound "
             "| peak GiB bf16 / int8 |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in result["rows"]:
        b, i = r["mixed_bf16"], r["mixed_int8"]
        tokens = _tokens(r["overrides"])
        lines.append(f"| {r['case']} | {tokens} | {_ms(b['modeled']['seconds'])} | {_ms(i['modeled']['seconds'])} | "
                     f"{r['ratio']:.3f} | {r['amdahl']:.3f} | {_ms(b['roofline_seconds'])} | "
                     f"{_ms(i['roofline_seconds'])} | {r['amdahl_roofline']:.3f} | "
                     f"{b['peak_bytes'] / 2**30:.2f} / {i['peak_bytes'] / 2**30:.2f} |")
    lines += ["", "Per layer: the ops a layer's module path names (`block_N`), over the layers; the bound: the "
              "same with the matmuls at twice the rate.", "",
              "| case | tokens | bf16 ms per layer | int8 ms per layer | int8 / bf16 | Amdahl bound per layer |",
              "|---|---|---:|---:|---:|---:|"]
    for r in result["rows"]:
        b, i = r["mixed_bf16"]["per_layer"], r["mixed_int8"]["per_layer"]
        lines.append(f"| {r['case']} | {_tokens(r['overrides'])} | {_ms(b)} | {_ms(i)} | {i / b:.3f} | "
                     f"{r['amdahl_per_layer']:.3f} |")
    if result["extrapolations"]:
        lines += ["", "| extrapolated | bf16 ms (per layer + fixed) | int8 ms (per layer + fixed) | int8 / bf16 | "
                  "per layer | Amdahl bound |", "|---|---:|---:|---:|---:|---:|"]
        for name, e in result["extrapolations"].items():
            b, i = e["mixed_bf16"], e["mixed_int8"]
            lines.append(f"| {name} | {_ms(b['seconds'])} ({_ms(b['per_layer'])} + {_ms(b['fixed'])}) | "
                         f"{_ms(i['seconds'])} ({_ms(i['per_layer'])} + {_ms(i['fixed'])}) | {e['ratio']:.3f} | "
                         f"{e['per_layer_ratio']:.3f} | {e['amdahl']:.3f} |")
    for r in result["rows"]:
        lines += ["", f"Where {r['case']}'s step goes (modeled ms by module kind):", "",
                  "| kind | bf16 | int8 |", "|---|---:|---:|"]
        for name, _ in KINDS:
            lines.append(f"| {name} | {_ms(r['mixed_bf16']['by_kind'].get(name, 0.0))} | "
                         f"{_ms(r['mixed_int8']['by_kind'].get(name, 0.0))} |")
    gpt2 = next((r for r in result["rows"] if r["case"] == "gpt2-small" and r.get("differences")), None)
    if gpt2 is not None:
        lines += ["", "Where gpt2-small's int8 step differs most from its bf16 step, op by op (modeled ms; module "
                  "kind / op kind and name, the layers' ops summed): a Pallas kernel is a custom call XLA cannot fuse "
                  "into, so the elementwise work bf16's matmul fusions carry runs as ops of its own, through HBM, "
                  "where the kernels do not take it in (they take a bias and its gradient, the activation between "
                  "two projections, the logits' float32 and a query's scale: docs/int8.md; not a LayerNorm and its "
                  "gradient).", "",
                  "| op | bf16 | int8 | int8 - bf16 |", "|---|---:|---:|---:|"]
        for name, b, i in gpt2["differences"]:
            lines.append(f"| {name} | {_ms(b)} | {_ms(i)} | {(i - b) * 1e3:+.1f} |")
    env = result["environment"]
    lines += ["", f"jax {env['jax']}, libtpu's compile-only client on {env['device']}, {env['date']}; "
              f"reproduce: `{result['command']}`", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.int8_tpu_step", description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--cache", help="keep (and reuse) each compiled program here")
    p.add_argument("--out", default=str(RESULTS))
    args = p.parse_args(argv)
    names = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = [c for c in names if c not in CASES]
    if unknown:
        p.error(f"unknown case(s) {unknown}; valid: {', '.join(CASES)}")
    cache = pathlib.Path(args.cache) if args.cache else None
    rows = {name: case_row(name, cache) for name in names}
    extrapolations = {name: extrapolated(rows, cases, layers) for name, (cases, layers) in EXTRAPOLATIONS.items()
                      if all(c in rows for c in cases)}
    result = {"environment": environment(), "rows": list(rows.values()), "extrapolations": extrapolations,
              "command": command("benchmarks.int8_tpu_step", argv)}
    write_tables(args.out, "int8-tpu-step", result, markdown(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
