"""``python -m benchmarks [--quick]``: speed, memory and FLOPs of every policy on
every model, and the three headline ratios.

Prints a table, writes ``benchmarks/results/<device>.{json,md}`` (a quick run:
``runs/benchmarks/<device>-quick.{json,md}``, so it never overwrites the
committed tables; ``--out DIR`` for elsewhere) and prints as its last line one JSON object with ``overhead_ratio``,
``loss_scale_overhead_ratio`` and ``memory_ratio``. Compiled programs are kept
in a persistent cache (:mod:`train.experiment.compile_cache`; ``--cache-dir``,
``--no-cache``), so a second run compiles nothing it compiled before.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import shlex
import sys
import time

import jax

from benchmarks import report, suite
from train.experiment import compile_cache
from benchmarks.workloads import DEFAULT_POLICY_NAMES, LARGE_VOCABULARY, MODELS, POLICY_NAMES, SIZES, default_models, workload


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="small models and short timings (under 3 minutes on 2 CPU "
                                                        "cores)")
    p.add_argument("--size", choices=SIZES, help="model sizes (default: full, gpu on a GPU, quick with --quick)")
    p.add_argument("--models", nargs="+", choices=MODELS,
                   help=f"default: all; at quick size all but {', '.join(LARGE_VOCABULARY)} (their 50,304-token "
                        f"vocabulary is a full-size workload)")
    p.add_argument("--policies", nargs="+", choices=POLICY_NAMES, default=list(DEFAULT_POLICY_NAMES),
                   help=f"default: {', '.join(DEFAULT_POLICY_NAMES)}")
    p.add_argument("--steps", type=int, help="timed steps per median (default 20; at least 20)")
    p.add_argument("--rounds", type=int, help="alternating rounds per ratio (default 10; 20 on a GPU)")
    p.add_argument("--out", help=f"results directory (default: {report.RESULTS.relative_to(report.RESULTS.parent.parent)} "
                                 f"for full sizes, runs/benchmarks for quick ones); given, it also holds "
                                 f"partial.json, rewritten after each row and ratio")
    p.add_argument("--save-programs", metavar="DIR", help="write each compiled step's optimized HLO there "
                                                              "(<model>-<policy>-<loss scale>-<rules|norules>.hlo, "
                                                              "hand_written-<model>.hlo)")
    p.add_argument("--cache-dir", help=f"persistent compilation cache (default: ${compile_cache.ENV}, "
                                       f"$JAX_COMPILATION_CACHE_DIR or ~/.cache/flax-mixed-precision/jax)")
    p.add_argument("--no-cache", action="store_true", help="compile everything afresh, cache nothing")
    return p


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    args = _parser().parse_args(argv)
    if args.steps is not None and args.steps < 20:
        _parser().error(f"--steps must be at least 20 (medians over fewer steps are noise), got {args.steps}")
    cache = None if args.no_cache else compile_cache.enable(args.cache_dir)
    if "fp32" not in args.policies:
        args.policies.insert(0, "fp32")  # the baseline every ratio is against
    size = args.size or ("quick" if args.quick else ("gpu" if jax.default_backend() == "gpu" else "full"))
    rounds, per_round = {"quick": (10, 3), "full": (10, 2), "gpu": (20, 5)}[size]
    models = tuple(args.models) if args.models else default_models(size)
    settings = suite.Settings(size=size, steps=args.steps or 20, rounds=args.rounds or rounds,
                              steps_per_round=per_round, models=models, policies=tuple(args.policies),
                              programs=args.save_programs,
                              partial=str(pathlib.Path(args.out) / "partial.json") if args.out else None)
    print(f"compilation cache: {cache or 'off'}", flush=True)
    start = time.perf_counter()
    results = suite.run(settings, log=lambda line: print(line, flush=True))
    results.update(
        environment=report.environment(), settings=vars(settings) | {"models": list(settings.models),
                                                                      "policies": list(settings.policies)},
        models={m: workload(m, size).describe() for m in settings.models},
        command=shlex.join(["python", "-m", "benchmarks", *argv]), wall_seconds=time.perf_counter() - start)
    json_path, md_path = report.save(results, report.results_dir(args.out, size))
    print()
    print(report.table(results))
    print(f"\nwrote {json_path} and {md_path} ({results['wall_seconds']:.0f} s)")
    print(json.dumps(report.headline(results)))
    return results


if __name__ == "__main__":
    main()
