"""The command line: ``python -m train CONFIG [key=value ...]`` (also ``mp-train``)."""

from __future__ import annotations

import argparse
import sys
from typing import Callable

import yaml

from train.config import ConfigError, distributed_settings, help_text, load_config, to_dict
from train.config.files import with_origin
from train.data import DataError

USAGE = "python -m train CONFIG [key=value ...]"
DESCRIPTION = """\
Train the experiment a YAML config describes, with dotted key=value overrides, e.g.

  python -m train configs/default.yaml
  python -m train configs/fmnist_resnet_mixed_f16.yaml steps=200 workdir=runs/try optimizer.lr=3e-4

Outputs go to WORKDIR: metrics.jsonl, config.yaml (the resolved config), summary.json,
checkpoints/ and tensorboard/. Rerunning the same command resumes from the newest
checkpoint; a larger steps= continues a finished run.

  python -m train export RUN --dtype bf16 OUT

writes a trained run's weights for serving (LoRA adapters merged, float32 kept where the
run's precision rules keep it; python -m train export --help).

  python -m train sample RUN --prompt "ROMEO:" --tokens 200 --dtype bf16

generates text from a trained language model with a KV cache (python -m train sample --help)."""
EXPORT_USAGE = ("python -m train export RUN --dtype {bf16,f16,f32,int8} OUT [--check-accuracy] [--diagnose] "
                "['precision.rules=[...]']")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m train", usage=USAGE, description=DESCRIPTION, epilog=help_text(),
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", nargs="?", help="the experiment's YAML file (see configs/)")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides of config fields")
    parser.add_argument("--print-config", action="store_true",
                        help="print the resolved config and exit without training")
    parser.add_argument("--explain", action="store_true",
                        help="print what the precision policy does to the model (per module: param and "
                             "matmul dtypes, half-precision share, float32 islands) and, on a mesh of more than one "
                             "device, what a train step sends between devices; exit without training")
    parser.add_argument("--check", action="store_true",
                        help="check everything a run checks before it computes (config, data, model, task, mesh, "
                             "workdir) and exit without training")
    parser.add_argument("--diagnose", action="store_true",
                        help="run training steps with every op probed from the config's state (or the newest "
                             "checkpoint): where float16/bfloat16 overflow, underflow or round away, per module and "
                             "op, with changes verified to fix it; writes WORKDIR/diagnosis.json and exits without "
                             "training (checkpoints are only read)")
    parser.add_argument("--diagnose-steps", type=int, default=1, metavar="N",
                        help="with --diagnose: how many steps to diagnose (default 1)")
    parser.add_argument("--compile-for", metavar="TARGET",
                        help="compile one train step for a GPU or TPU this machine need not have (h100, h200, a100, a "
                             "GpuTargetConfigProto text file: needs JAX's CUDA plugin, pip install '.[gpu-compile]'; "
                             "v5e, v5p, v6e or a slice such as v5p:2x2x2: needs libtpu, pip install "
                             "'.[tpu-compile]'), building the state abstractly, and report whether it fits the "
                             "device's memory, its kernels (cuDNN attention, GEMMs by library and operand dtypes, "
                             "FP8 GEMMs; a TPU's matmuls), float32 GEMMs under a half policy and the collectives; "
                             "writes WORKDIR/compiled-TARGET.json and exits without training (exit 1: does not fit)")
    parser.add_argument("--devices", type=int, metavar="N",
                        help="with --compile-for: how many devices of the target (default: mesh.data * mesh.fsdp * mesh.tensor; "
                             "a given TPU slice's chips under mesh.data=-1; else 1); for a TPU, the smallest slice "
                             "holding them")
    parser.add_argument("--pick-policy", action="store_true",
                        help="measure candidate precision policies on this experiment and this machine (the "
                             "doctor's numerics, the loss after N steps against float32, step time, memory) and pick "
                             "the fastest within tolerance that fits; writes WORKDIR/policy_pick.json and .yaml and "
                             "exits without training (docs/policy-pick.md)")
    parser.add_argument("--candidates", action="append", metavar="'POLICY[ key=value...];...'",
                        help="with --pick-policy: the candidates, ';' between them, each a policy or preset "
                             "optionally followed by precision settings, e.g. 'fp32;mixed_bf16;mixed_f16 "
                             "rules=[[LayerNorm, f32]]' (default: fp32, mixed_bf16, mixed_f16, mixed_fp8, "
                             "mixed_int8, lean_bf16, lean_int8)")
    parser.add_argument("--steps", type=int, metavar="N",
                        help="with --pick-policy: train steps per candidate (default 30, at most the config's steps)")
    parser.add_argument("--tolerance", type=float, metavar="X",
                        help="with --pick-policy: the loss change allowed against float32, relative (default 0.01)")
    parser.add_argument("--prefer", choices=("speed", "memory"),
                        help="with --pick-policy: the fastest eligible policy (default) or the leanest")
    parser.add_argument("--mesh", metavar="data=D,fsdp=F,tensor=T",
                        help="the device mesh, as the overrides mesh.data=D mesh.fsdp=F mesh.tensor=T")
    return parser


class _Origin(str):
    """The config file's path; called with an error about the config, the error after where
    the key it names was set (the file, or the override on the command line). An error that
    follows a Ctrl-C is the interruption (``KeyboardInterrupt``), whatever it says."""

    def __new__(cls, path: str, overrides: list[str], pressed: Callable[[], bool] = lambda: False):
        origin = super().__new__(cls, path)
        origin.overrides = list(overrides)
        origin.pressed = pressed
        return origin

    def __call__(self, error: Exception) -> str:
        if self.pressed():
            raise KeyboardInterrupt from None
        return with_origin(str(error), str(self), self.overrides)


def _fail(message: str, code: int, prefix: str = "error: ") -> int:
    print(prefix + " ".join(line.strip() for line in message.splitlines()), file=sys.stderr)  # one line
    return code


def main(argv: list[str] | None = None) -> int:
    """Parses the command line, runs the experiment, returns the exit status (see :func:`_main`).
    A Ctrl-C is never lost to a garbage-collection callback (:mod:`train.experiment.interrupts`),
    and an error that follows one (JAX may turn an interrupt inside a trace into an error of its
    own, which the model checks then report as the model's) is reported as the interruption."""
    from train.experiment.interrupts import reliable_interrupts

    with reliable_interrupts() as pressed:
        try:
            return _main(argv, pressed)
        except KeyboardInterrupt:  # while looking at a config (--explain, --check, ...): nothing to save
            return _fail("interrupted", 130, prefix="")
        except Exception:
            if pressed():
                return _fail("interrupted", 130, prefix="")
            raise


def _main(argv: list[str] | None = None, pressed: Callable[[], bool] = lambda: False) -> int:
    """Parses the command line, runs the experiment, returns the exit status.

    Exit status: 0 done, 2 bad config or data (nothing was computed), 1
    training stopped on non-finite gradients (last good state saved), 3 a
    checkpoint or the metrics could not be written, or no intact checkpoint could
    be read (earlier ones kept), 130 interrupted (checkpoint saved).
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["export"]:  # a subcommand: configs are YAML paths, never this word
        return _export(argv[1:])
    if argv[:1] == ["sample"]:  # text from a trained language model (train.serving.cli)
        from train.serving.cli import main as sample

        return sample(argv[1:])
    parser = _parser()
    args = parser.parse_intermixed_args(argv)
    if args.config is None:
        parser.error("give the experiment's config file, e.g. python -m train configs/default.yaml "
                     "(key=value overrides are optional)")
    if args.mesh is not None:
        try:
            args.overrides += _mesh_overrides(args.mesh)
        except ValueError as e:
            return _fail(str(e), 2)
    if not args.print_config:
        from train.parallel.distributed import MeshError, initialize_distributed

        try:  # before anything touches a device, as JAX's multi-process runtime requires
            initialize_distributed(**distributed_settings(args.config, args.overrides).model_dump())
        except MeshError as e:
            return _fail(f"{args.config}: {e}", 2)
    try:
        config = load_config(args.config, args.overrides)
    except ConfigError as e:
        return _fail(str(e), 2)
    if args.print_config:
        print(yaml.safe_dump(to_dict(config), sort_keys=False), end="")
        return 0
    path = _Origin(args.config, args.overrides, pressed)  # where a key named by an error was set
    if args.compile_for is not None:
        return _compile_for(path, config, args.compile_for, args.devices)
    if args.devices is not None:
        return _fail("--devices goes with --compile-for (a run takes the devices it finds)", 2)
    picking = [f"--{k.replace('_', '-')}" for k in ("candidates", "steps", "tolerance", "prefer")
               if getattr(args, k) is not None]
    if args.pick_policy:
        return _pick_policy(path, config, args)
    if picking:
        return _fail(f"{picking[0]} goes with --pick-policy", 2)
    if args.explain:
        return _explain(path, config)
    if args.check:
        return _check(path, config)
    if args.diagnose:
        return _diagnose(path, config, args.diagnose_steps)
    from train.training.checkpoint import CheckpointError
    from train.experiment.loop import NonFiniteError, run  # heavy imports (jax, orbax) only when training
    from train.tracking.metrics import OutputError

    try:
        run(config)
    except (ConfigError, DataError) as e:
        if pressed():  # the press, turned into an error by the trace it landed in
            return _stopped(config, "interrupted", 130, prefix="")
        return _fail(path(e), 2)
    except NonFiniteError as e:
        return _stopped(config, str(e), 1)
    except (CheckpointError, OutputError) as e:
        return _stopped(config, str(e), 3)
    except KeyboardInterrupt as e:  # Ctrl-C is no error: what was saved, and how to go on
        return _stopped(config, str(e) or "interrupted", 130, prefix="")
    return 0


def _export(argv: list[str]) -> int:
    """``python -m train export RUN --dtype bf16 OUT``: exit 0 written, 2 bad input (nothing
    written), 3 OUT could not be written."""
    parser = argparse.ArgumentParser(
        prog="python -m train export", usage=EXPORT_USAGE,
        description="Write the newest checkpoint of RUN (a workdir of this framework) to OUT (new or empty) in "
                    "DTYPE for serving: LoRA adapters merged into their weights, a frozen 8/4-bit base read back, "
                    "the params of modules the run's precision rules keep in float32 (normalization layers) "
                    "left in float32. OUT is a Hugging Face directory for a model read from one, else "
                    "params.safetensors; with export.json; model.init_from=OUT reads either (docs/export.md).")
    parser.add_argument("run", metavar="RUN", help="the run's workdir (config.yaml and checkpoints/ inside)")
    parser.add_argument("out", metavar="OUT", help="the directory to write (must not exist, or be empty)")
    parser.add_argument("--dtype", required=True, metavar="DTYPE",
                        help="bf16, f16, f32, or int8 (weight-only, a scale per output channel; the rest bf16)")
    parser.add_argument("--check-accuracy", action="store_true",
                        help="also evaluate the exported weights against float32 on the run's eval split")
    parser.add_argument("--diagnose", action="store_true",
                        help="also run the numerics doctor on serving the exported weights (the eval forward "
                             "pass in DTYPE on one eval batch): what overflows only there, and the verified rule "
                             "that fixes it; written to OUT/diagnosis.json")
    parser.add_argument("overrides", nargs="*", metavar="precision.rules=[...]",
                        help="the rules that keep modules in float32, in place of the run's (a doctor's fix)")
    args = parser.parse_intermixed_args(argv)
    from train.inspections.export import ExportError, export_run, format_report  # heavy imports: jax, orbax

    try:
        report = export_run(args.run, args.out, args.dtype, check_accuracy=args.check_accuracy,
                            diagnose=args.diagnose, overrides=args.overrides)
    except ExportError as e:
        return _fail(str(e), 2)
    except OSError as e:
        return _fail(f"could not write {args.out}: {e.strerror or e}", 3)
    print(format_report(report))
    return 0


def _stopped(config, message: str, code: int, prefix: str = "error: ") -> int:
    """A run that stopped: its one line; what libraries say while the process ends goes to the workdir's log."""
    from train.tracking.library_log import to_file_until_exit

    to_file_until_exit(config.workdir)
    return _fail(message, code, prefix)


def _check(path: _Origin, config) -> int:
    from train.experiment.loop import check_experiment

    try:
        print("ok: " + check_experiment(config))
    except (ConfigError, DataError) as e:
        return _fail(path(e), 2)
    return 0


def _diagnose(path: _Origin, config, steps: int) -> int:
    from train.inspections.checkup import diagnose_experiment

    if steps < 1:
        return _fail(f"--diagnose-steps must be at least 1, got {steps}", 2)
    from train.training.checkpoint import CheckpointError

    try:
        diagnose_experiment(config, steps)
    except (ConfigError, DataError) as e:
        return _fail(path(e), 2)
    except CheckpointError as e:
        return _fail(str(e), 3)
    except OSError as e:
        return _fail(f"could not write the diagnosis to {config.workdir}: {e.strerror or e}", 3)
    return 0


def _pick_policy(path: _Origin, config, args: argparse.Namespace) -> int:
    import precision
    from train.inspections.policy_pick import pick_policy

    tolerance = 0.01 if args.tolerance is None else args.tolerance
    try:
        pick_policy(config, args.candidates, args.steps, tolerance, args.prefer or "speed")
    except (ConfigError, DataError) as e:
        return _fail(path(e), 2)
    except precision.PolicyError as e:  # an unknown candidate (bad input), or none passed (measured)
        measured = str(e).startswith("no candidate is eligible")
        return _fail(str(e) if measured else f"--candidates: {e}", 1 if measured else 2)
    except ValueError as e:  # steps, tolerance or prefer out of range: the message starts with its name
        return _fail(f"--{e}", 2)
    except OSError as e:
        return _fail(f"could not write the pick to {config.workdir}: {e.strerror or e}", 3)
    return 0


def _mesh_overrides(text: str) -> list[str]:
    """``data=2,fsdp=4,tensor=1`` as the overrides ``mesh.data=2 mesh.fsdp=4 mesh.tensor=1``."""
    overrides = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = part.partition("=")
        if not sep or key.strip() not in ("data", "fsdp", "tensor"):
            raise ValueError(f"--mesh {text!r}: give data=D,fsdp=F,tensor=T, any of them (e.g. --mesh "
                             f"data=2,fsdp=4 or --mesh fsdp=2,tensor=4)")
        overrides.append(f"mesh.{key.strip()}={value.strip()}")
    return overrides


def _compile_for(path: _Origin, config, target: str, devices: int | None) -> int:
    from train.inspections.compile_for import DoesNotFitError, TargetError, compile_for, write_report

    try:
        report = compile_for(config, target, devices)
    except TargetError as e:
        return _fail(str(e), 2)
    except DoesNotFitError as e:  # the compiler refused it: exit 1, as a report that does not fit
        return _fail(str(e), 1)
    except (ConfigError, DataError) as e:
        return _fail(path(e), 2)
    print(report)
    try:
        print(f"\nwrote {write_report(report, config.workdir)}")
    except OSError as e:
        return _fail(f"could not write the report to {config.workdir}: {e.strerror or e}", 3)
    return 0 if report.fits else 1


def _explain(path: _Origin, config) -> int:
    from train.inspections.explain import (explain_experiment, explain_experiment_communication,
                                           explain_experiment_layout, explain_experiment_loss, explain_experiment_state)
    from train.experiment.loop import build_experiment

    try:
        experiment = build_experiment(config)  # once: data, task and model serve both reports
        print(explain_experiment(config, experiment))
        print(f"\n{explain_experiment_state(config, experiment)}")
        print(explain_experiment_loss(config, experiment))
        layout = explain_experiment_layout(config, experiment)
        communication = explain_experiment_communication(config, experiment)
    except (ConfigError, DataError) as e:
        return _fail(path(e), 2)
    if layout is not None:
        print(f"\n{layout}")
    if communication is not None:
        print(f"\n{communication}")
        print("\n".join(communication.layer_lines(top=12)))
    return 0
