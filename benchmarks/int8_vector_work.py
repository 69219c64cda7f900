"""What the TPU step model does not see of the int8 kernels: the vector work of their quantization.

The int8 Pallas kernels (:mod:`precision.autocast.scaled.int8_pallas`) quantize their 16-bit
operands in VMEM; the step model (:mod:`train.inspections.tpu_time`) times a kernel as a roofline
of its FLOPs and HBM bytes, and XLA writes no estimate of a custom call, so that vector work (an
absmax, a division, a rounding per element) is not in the modeled step. XLA's own cost model did
price it where the XLA recipe quantized in fusions of its own: this script sums XLA's estimate of
those passes (ops without matrix FLOPs that produce int8, and the absmax reductions) in a program
compiled with the recipe and in one compiled with the kernels (what still quantizes outside them:
the weights), and gives the step the model would give the kernels' program if the difference did
not overlap with the matrix unit at all: a pessimistic edge for the modeled one.

    python -m benchmarks.int8_vector_work --recipe DIR --kernels DIR [--bf16 DIR] [--out DIR]

Each DIR holds ``CASE-mixed_int8.txt`` programs as ``benchmarks.int8_tpu_step --cache DIR`` keeps
them (the recipe's: that benchmark run at a commit before the kernels, or on a slice); ``--bf16``
the ``CASE-mixed_bf16.txt`` ones (default: ``--kernels``). A model, never a measurement.
"""

from __future__ import annotations

import argparse
import pathlib
from typing import Any

from benchmarks.report import RESULTS, command, environment, write_tables
from train.inspections.tpu_time import TPU_DATASHEETS, model_tpu_step, op_times, xla_cycles_by_op


def quantization_seconds(text: str, chip: str = "v5e") -> float:
    """XLA's estimate (seconds) of a program's quantization outside its matmuls: ops with no matrix
    FLOPs producing int8, and absmax reductions."""
    sheet, cycles = TPU_DATASHEETS[chip], xla_cycles_by_op(text)
    ops = [o.kernel for o in op_times(text, chip)]
    return sum(cycles.get(k.name, 0) * k.launches for k in ops
               if not k.flops and (k.dtype == "s8" or "abs_reduce" in k.name)) / sheet.clock


def case_row(case: str, recipe: str, kernels: str, bf16: str) -> dict[str, Any]:
    """One case's modeled steps and the vector work the kernels' model leaves out."""
    moved = quantization_seconds(recipe) - quantization_seconds(kernels)
    steps = {name: model_tpu_step(text, "v5e").seconds for name, text in
             (("bf16", bf16), ("recipe", recipe), ("kernels", kernels))}
    return {"case": case, **steps, "moved": moved, "pessimistic": steps["kernels"] + moved}


def markdown(result: dict[str, Any]) -> str:
    lines = ["# The int8 kernels' vector work, which the modeled v5e step does not see", "",
             "XLA's estimate of the recipe's quantization passes (ops producing int8 and absmax reductions) less what "
             "still quantizes outside the kernels: the vector work the kernels do in VMEM. **Pessimistic**: the "
             "kernels' modeled step plus all of it, none overlapped with the matrix unit. A model, never a "
             "measurement.", "",
             "| case | bf16 ms | recipe int8 ms | kernels int8 ms | int8 / bf16 | vector work moved ms | pessimistic "
             "ms | pessimistic / bf16 |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in result["rows"]:
        lines.append(f"| {r['case']} | {r['bf16'] * 1e3:.1f} | {r['recipe'] * 1e3:.1f} | {r['kernels'] * 1e3:.1f} | "
                     f"{r['kernels'] / r['bf16']:.3f} | {r['moved'] * 1e3:.1f} | {r['pessimistic'] * 1e3:.1f} | "
                     f"{r['pessimistic'] / r['bf16']:.3f} |")
    env = result["environment"]
    lines += ["", f"jax {env['jax']}, {env['date']}; reproduce: `{result['command']}`", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.int8_vector_work", description=__doc__.split("\n\n")[0])
    p.add_argument("--recipe", required=True)
    p.add_argument("--kernels", required=True)
    p.add_argument("--bf16")
    p.add_argument("--out", default=str(RESULTS))
    args = p.parse_args(argv)
    recipe, kernels = pathlib.Path(args.recipe), pathlib.Path(args.kernels)
    bf16 = pathlib.Path(args.bf16 or args.kernels)
    cases = sorted(f.name.removesuffix("-mixed_int8.txt") for f in kernels.glob("*-mixed_int8.txt")
                   if (recipe / f.name).exists() and (bf16 / f.name.replace("int8", "bf16")).exists())
    if not cases:
        p.error(f"no CASE-mixed_int8.txt in both {recipe} and {kernels} (with its mixed_bf16 one in {bf16})")
    rows = [case_row(c, *((d / f"{c}-mixed_{p}.txt").read_text() for d, p in
                          ((recipe, "int8"), (kernels, "int8"), (bf16, "bf16")))) for c in cases]
    result = {"environment": environment(), "rows": rows, "command": command("benchmarks.int8_vector_work", argv)}
    write_tables(args.out, "int8-vector-work", result, markdown(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
