"""Does a memory-bound kernel's share of the bandwidth depend on its size? The H200's kernels against their bytes.

:mod:`train.inspections.gpu_time` gives each memory-bound kernel (an elementwise fusion, a
reduction, a copy) ``latency + bytes / (HBM bandwidth x share)``. This script measures both
numbers on the H200 profiles that list every kernel of a step
(``profile-gpt2_small-{mixed_bf16,hand_written_bf16}-nvidia-h200.json``: the seconds per step
of each kernel, by the name the GPU ran it under):

1. compiles those steps here for an H200 (compile-only) and checks each is the program the GPU
   ran: its launch count is the one the GPU recorded beside the profile (``modeled.launches``);
2. joins each profiled kernel with the bytes its launches move (:mod:`train.inspections.hlo_kernels`).
   XLA compiles kernels of the same code once, under one name for all of them (an instruction's
   ``deduplicated_name``), and the profile sums their launches under one of their names: the
   profile's name matches the group holding an instruction of that name. Memory-bound kernels
   only (no matrix FLOPs: cuBLAS and cuDNN kernels are not XLA fusions);
3. says the share of the bandwidth each size of kernel reached, and fits
   ``latency + bytes / (bandwidth x share)`` on one profile's kernels (least squares of the
   logarithm of modeled over measured time, each kernel weighted by its launches), then says how
   far the fit is, kernel by kernel and in total, from the other profile's kernels, and the modeled
   steps from the measured ones.

    python -m benchmarks.kernel_bandwidth [--fit hand_written_bf16] [--out DIR]

Run it where the profiled programs compile as they did on the GPU: a checkout of commit 0ef28be
(the H200 lease of 2026-11-28) with this file and ``train/inspections/{hlo_kernels,gpu_time}.py``
copied in; a program that differs is said and left out. Needs JAX's CUDA plugin. Writes
``kernel-bandwidth.{json,md}``; the fitted numbers belong in ``train.inspections.gpu_time.CALIBRATION``.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import defaultdict
from typing import Any, NamedTuple

import numpy as np
import scipy.optimize

from benchmarks.report import RESULTS, environment, write_tables
from train.inspections.gpu_time import CALIBRATION, datasheet, model_step
from train.inspections.hlo_kernels import read_hlo_kernels
from train.inspections.targets import get_target, target_devices

PROFILES = {"mixed_bf16": "profile-gpt2_small-mixed_bf16-nvidia-h200.json",
            "hand_written_bf16": "profile-gpt2_small-hand_written_bf16-nvidia-h200.json"}
#: Bins of bytes per launch for the table of shares.
BINS = ((0, 1e6), (1e6, 1e7), (1e7, 1e8), (1e8, 1e9), (1e9, float("inf")))
_MEMORY_KINDS = ("fusion", "reduction", "copy")


class Kernel(NamedTuple):
    """One profiled memory-bound kernel: its launches per step, the bytes each moves, seconds per launch."""

    name: str
    kind: str
    launches: int
    bytes: float
    seconds: float


def compiled(policy: str) -> str:
    """The optimized HLO of the profiled GPT-2-small step under ``policy``, compiled for an H200."""
    from benchmarks.model_calibration import _hand_written, _ours
    from train.parallel.distributed import Layout, make_mesh

    target = get_target("h200")
    layout = Layout(make_mesh(1, 1, target_devices(target)))
    if policy == "hand_written_bf16":
        return _hand_written("gpt2_small", layout)
    return _ours("gpt2_small", policy, "none", None, target, layout)


def kernel_groups(hlo_text: str) -> tuple[dict[str, dict[str, Any]], dict[str, str]]:
    """The program's kernels grouped as XLA compiles them (one group per ``deduplicated_name``):
    launches, bytes and FLOPs per group, kinds; and each instruction's group."""
    group_of = {}
    for line in hlo_text.splitlines():
        m = re.match(r"\s*(?:ROOT )?%([\w.\-]+) = ", line)
        if m:
            shared = re.search(r'deduplicated_name="([\w.\-]+)"', line)
            group_of[m.group(1)] = shared.group(1) if shared else m.group(1)
    groups: dict[str, dict[str, Any]] = defaultdict(lambda: {"launches": 0, "bytes": 0.0, "flops": 0.0,
                                                             "kinds": set()})
    for k in read_hlo_kernels(hlo_text):
        g = groups[group_of.get(k.name, k.name)]
        g["launches"] += k.launches
        g["bytes"] += k.bytes * k.launches
        g["flops"] += k.flops * k.launches
        g["kinds"].add(k.kind)
    return dict(groups), group_of


def joined(profile: dict[str, Any], hlo_text: str) -> list[Kernel]:
    """The profile's memory-bound kernels with their bytes (see the module's docstring)."""
    groups, group_of = kernel_groups(hlo_text)
    by_name = {name.replace(".", "_"): group for name, group in group_of.items() if group in groups}
    out, seen = [], set()
    for entry in profile["top"]:
        group = by_name.get(entry["kernel"])
        if group is None or group in seen:
            continue
        seen.add(group)
        g = groups[group]
        if g["flops"] or not g["kinds"] <= set(_MEMORY_KINDS):
            continue
        out.append(Kernel(entry["kernel"], "/".join(sorted(g["kinds"])), g["launches"], g["bytes"] / g["launches"],
                          entry["seconds"] / g["launches"]))
    return out


def modeled_seconds(kernels: list[Kernel], latency: float, share: float, bandwidth: float) -> np.ndarray:
    """Each kernel's modeled seconds per launch: ``latency + bytes / (bandwidth x share)``."""
    return latency + np.array([k.bytes for k in kernels]) / (bandwidth * share)


def fit(kernels: list[Kernel], bandwidth: float) -> tuple[float, float]:
    """``(latency, share)`` minimizing the launch-weighted squares of log(modeled / measured)."""
    launches = np.array([k.launches for k in kernels], float)
    measured = np.array([k.seconds for k in kernels])

    def loss(p):
        latency, share = p[0] * 1e-6, p[1]
        if latency <= 0 or share <= 0:
            return np.inf
        return float((launches * np.log(modeled_seconds(kernels, latency, share, bandwidth) / measured) ** 2).sum())

    found = scipy.optimize.minimize(loss, [2.0, 0.6], method="Nelder-Mead", options={"xatol": 1e-4, "fatol": 1e-9})
    return float(found.x[0]) * 1e-6, float(found.x[1])


def errors(kernels: list[Kernel], latency: float, share: float, bandwidth: float) -> dict[str, float]:
    """How far the model is from ``kernels``: total time, and the median factor kernel by kernel."""
    launches = np.array([k.launches for k in kernels], float)
    measured = np.array([k.seconds for k in kernels])
    modeled = modeled_seconds(kernels, latency, share, bandwidth)
    return {"total_ratio": float((modeled * launches).sum() / (measured * launches).sum()),
            "median_factor": float(np.exp(np.median(np.abs(np.log(modeled / measured)))))}


def shares(kernels: list[Kernel], bandwidth: float) -> list[dict[str, Any]]:
    """Per bin of bytes per launch: kernels, launches, the median share of the bandwidth and the share of
    their bytes over their time."""
    out = []
    for low, high in BINS:
        chosen = [k for k in kernels if low <= k.bytes < high]
        if chosen:
            each = [k.bytes / k.seconds / bandwidth for k in chosen]
            out.append({"low": low, "high": high, "kernels": len(chosen), "launches": sum(k.launches for k in chosen),
                        "median": float(np.median(each)), "min": min(each), "max": max(each),
                        "bytes_weighted": sum(k.bytes * k.launches for k in chosen)
                        / sum(k.seconds * k.launches for k in chosen) / bandwidth})
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(prog="python -m benchmarks.kernel_bandwidth", description=__doc__.split("\n\n")[0])
    p.add_argument("--fit", choices=tuple(PROFILES), default="hand_written_bf16", help="the profile to fit on")
    p.add_argument("--out", default=str(RESULTS))
    args = p.parse_args(argv)
    target = get_target("h200")
    bandwidth = datasheet(target).bandwidth
    steps, kernels = {}, {}
    for policy, name in PROFILES.items():
        profile = json.loads((RESULTS / name).read_text())
        text = compiled(policy)
        step = model_step(text, target)
        steps[policy] = {"profile": name, "launches_measured_program": profile["modeled"]["launches"],
                         "launches_here": step.launches, "wall": profile["step_seconds_traced"],
                         "busy": profile["busy_seconds"]}
        if step.launches != profile["modeled"]["launches"]:
            print(f"{policy}: not the program the GPU ran ({step.launches} launches here, "
                  f"{profile['modeled']['launches']} there): left out", file=sys.stderr)
            continue
        kernels[policy] = joined(profile, text)
        steps[policy] |= {"text": text, "memory_bound_measured": sum(k.seconds * k.launches for k in kernels[policy])}
    if args.fit not in kernels:
        p.error(f"the {args.fit} program differs from the one profiled: run in a checkout of 0ef28be")
    latency, share = fit(kernels[args.fit], bandwidth)
    calibration = CALIBRATION._replace(min_kernel_seconds=latency, bandwidth_efficiency=share)
    result = {"environment": environment(), "fit_on": args.fit, "latency_seconds": latency, "share": share,
              "bandwidth": bandwidth, "ceiling": _ceiling(), "profiles": {}}
    for policy, found in kernels.items():
        step = steps.pop(policy)
        modeled = model_step(step.pop("text"), target, calibration)
        result["profiles"][policy] = step | {
            "kernels": [k._asdict() for k in found], "shares": shares(found, bandwidth),
            "errors": errors(found, latency, share, bandwidth),
            "errors_constant_share": _constant_share_errors(found, bandwidth),
            "modeled_step": modeled.seconds}
    write_tables(args.out, "kernel-bandwidth", result, markdown(result))
    return result


def _constant_share_errors(kernels: list[Kernel], bandwidth: float) -> dict[str, float]:
    """The same errors under the model this fit replaces: ``max(bytes / (bandwidth x 0.589), 2 us)``."""
    launches = np.array([k.launches for k in kernels], float)
    measured = np.array([k.seconds for k in kernels])
    modeled = np.maximum(np.array([k.bytes for k in kernels]) / (bandwidth * 0.589), 2e-6)
    return {"total_ratio": float((modeled * launches).sum() / (measured * launches).sum()),
            "median_factor": float(np.exp(np.median(np.abs(np.log(modeled / measured)))))}


def _ceiling() -> dict[str, Any] | None:
    """The H200's measured copy bandwidth (``benchmarks.ceilings``), for comparison with the fitted share."""
    found = sorted(RESULTS.glob("ceilings-nvidia-h200*.json"))
    if not found:
        return None
    copy = json.loads(found[-1].read_text())["copy"]
    return {"file": found[-1].name, "bytes_per_second": copy["bytes_per_second"]}


def markdown(result: dict[str, Any]) -> str:
    bw = result["bandwidth"]
    lines = ["# A memory-bound kernel's share of the bandwidth, by its size (H200 profiles)", "",
             "`python -m benchmarks.kernel_bandwidth` (in a checkout of 0ef28be, the profiled programs, with it and "
             "`train/inspections/{hlo_kernels,gpu_time}.py` copied in; compile-only H200 here, jax "
             f"{result['environment']['jax']}). Each memory-bound kernel of the profiled GPT-2-small steps (H200, "
             "2026-11-28) against the bytes its launches move in the program compiled here (the same launch count as "
             f"the GPU's). Shares of the datasheet's {bw / 1e12:.1f} TB/s.", ""]
    for policy, prof in result["profiles"].items():
        lines += [f"## {policy}: {len(prof['kernels'])} memory-bound kernels, {prof['memory_bound_measured'] * 1e3:.2f} ms "
                  f"of the step's {prof['busy'] * 1e3:.2f} ms busy", "",
                  "| bytes per launch | kernels | launches | median share | range | share of their bytes over their time |",
                  "|---|---|---|---|---|---|"]
        for b in prof["shares"]:
            high = "" if b["high"] == float("inf") else f"{b['high'] / 1e6:g} MB"
            lines.append(f"| {b['low'] / 1e6:g} - {high or 'more'} | {b['kernels']} | {b['launches']} | {b['median']:.3f} "
                         f"| {b['min']:.3f} - {b['max']:.3f} | {b['bytes_weighted']:.3f} |")
        lines.append("")
    lat, share = result["latency_seconds"] * 1e6, result["share"]
    lines += [f"Fitted on {result['fit_on']}: a memory-bound kernel takes **{lat:.2f} us + bytes / ({share:.3f} x "
              f"bandwidth)**."]
    if result["ceiling"]:
        ceiling = result["ceiling"]["bytes_per_second"]
        lines[-1] += (f" The streaming share is the card's measured copy bandwidth: {ceiling / 1e12:.2f} TB/s = "
                      f"{ceiling / bw:.3f} of {bw / 1e12:.1f} (`{result['ceiling']['file']}`).")
    lines += ["", "| profile | fitted on it | total modeled / measured | median factor per kernel | the same, one share "
              "(max(bytes / (0.589 bw), 2 us)) | modeled step / measured (traced wall) |", "|---|---|---|---|---|---|"]
    for policy, prof in result["profiles"].items():
        e, c = prof["errors"], prof["errors_constant_share"]
        lines.append(f"| {policy} | {'yes' if policy == result['fit_on'] else 'no'} | {e['total_ratio']:.3f} | "
                     f"{e['median_factor']:.2f}x | {c['total_ratio']:.3f}, {c['median_factor']:.2f}x | "
                     f"{prof['modeled_step'] * 1e3:.2f} / {prof['wall'] * 1e3:.2f} ms "
                     f"({prof['modeled_step'] / prof['wall']:.2f}) |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
    sys.exit(0)
