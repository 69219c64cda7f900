"""Which policy for this model, on this machine: the decision from measurements
(``precision.pick_policy``), the measurements of an experiment (``train.pick_policy``,
``python -m train CONFIG --pick-policy``), and bad input in one line."""

import dataclasses
import json
import shlex

import pytest
import yaml
from helpers import ROOT
from test_diagnose_training import HOT_MODEL

import precision
import train
from precision import Measurement
from train.cli import main

DEFAULT = str(ROOT / "configs" / "default.yaml")
FIELDS = [f.name for f in dataclasses.fields(Measurement)]
#: The default experiment made tiny: a narrow MLP, small batches, one eval batch, nothing persistent.
TINY = ["model.hidden=[32]", "data.batch_size=32", "data.eval_batch_size=128", "data.eval_batches=1",
        "compile_cache=null", "progress=false", "inference_dtypes=[]"]


def _m(name, loss=1.0, ms=10.0, spread=0.1, policy=None, state=1000, peak=2000, **fields):
    """A measurement with step times around ``ms`` milliseconds, ``spread`` wide."""
    times = tuple((ms + spread * (i % 5 - 2) / 2) / 1e3 for i in range(20))
    return Measurement(name, policy or name, loss=loss, steps=20, step_seconds=times, state_bytes=state,
                       peak_bytes=peak, memory_limit=10**9, **fields)


# ----------------------------------------------------------------------------- the decision


def test_the_fastest_candidate_within_tolerance_is_picked_and_the_others_say_why():
    pick = precision.pick_policy([_m("fp32"), _m("mixed_bf16", 1.005, ms=5), _m("mixed_f16", 1.03, ms=4)])
    assert pick.choice.name == "mixed_bf16" and pick.overrides == ("precision.policy=mixed_bf16",)
    verdicts = {r.measurement.name: (r.verdict, r.reason) for r in pick.rows}
    assert verdicts["mixed_f16"][0] == "dropped" and "over the 1% tolerance" in verdicts["mixed_f16"][1]
    assert verdicts["fp32"] == ("eligible", "2.00x mixed_bf16's step time")
    assert pick.confidence.startswith("high: the next eligible, fp32, is 100% slower")
    table = pick.table()
    assert all(name in table for name in ("fp32", "mixed_bf16", "mixed_f16", "+0.50%", "+3.00%", "picked"))
    assert json.loads(json.dumps(pick.to_dict()))["picked"] == "mixed_bf16"


def test_a_difference_within_the_timing_spread_is_noise_and_keeps_float32():
    pick = precision.pick_policy([_m("fp32", ms=10, spread=1.0), _m("mixed_bf16", 1.001, ms=9.8, spread=1.0)],
                                 backend="cpu")
    assert pick.choice.name == "fp32"
    assert "within the timing spread" in pick.rows[0].reason and "noise" in pick.rows[0].reason
    assert pick.confidence.startswith("low") and "not faster here" in pick.table()


def test_prefer_memory_picks_the_fewest_bytes_and_a_step_that_does_not_fit_is_dropped():
    measured = [_m("fp32", state=4000, peak=5000), _m("mixed_bf16", 1.002, state=4000, peak=4500),
                _m("lean_bf16", 1.004, state=1500, peak=6000), _m("pure_bf16", 1.004, state=1000, peak=2 * 10**9)]
    pick = precision.pick_policy(measured, prefer="memory")
    assert pick.choice.name == "lean_bf16" and pick.confidence.startswith("high: bytes are exact")
    # Its step peaks higher than another's (an update's temporaries): said, the state decides.
    assert "its step peaks at 6 kB against mixed_bf16's 4.5 kB" in pick.rows[2].reason
    assert pick.rows[3].verdict == "dropped" and "more than the 1 GB of memory" in pick.rows[3].reason
    assert precision.pick_policy(measured, prefer="memory", tolerance=0.003).choice.name == "mixed_bf16"


def test_no_eligible_candidate_and_bad_choices_are_one_line():
    with pytest.raises(precision.PolicyError, match=r"^no candidate is eligible: fp32: loss after 20 steps is nan; "
                                                    r"mixed_f16: numerics: overflow in block$"):
        precision.pick_policy([_m("fp32", float("nan")), _m("mixed_f16", numerics="dropped",
                                                            numerics_note="overflow in block")])
    for kwargs, message in (({"tolerance": 1.5}, "tolerance must be a number in \\(0, 1\\)"),
                            ({"tolerance": 0}, "tolerance must be"), ({"prefer": "size"}, "prefer must be one of")):
        with pytest.raises(ValueError, match=message):
            precision.pick_policy([_m("fp32")], **kwargs)


def test_candidates_parse_with_their_rules_and_an_unknown_one_names_the_nearest_preset():
    parsed = precision.pick.parse_candidates("mixed_bf16; mixed_f16 rules=[[block, f32]] deny=[exp]")
    assert [c.name for c in parsed] == ["fp32", "mixed_bf16", "mixed_f16 rules=[[block, f32]] deny=[exp]"]
    assert parsed[2].settings == {"rules": [["block", "f32"]], "deny": ["exp"]}
    with pytest.raises(precision.PolicyError, match="Did you mean 'mixed_f16'"):
        precision.pick.parse_candidates(["fp32", "mixed_f61"])
    with pytest.raises(precision.PolicyError, match="rules"):
        precision.Candidate.parse("mixed_f16 rules=[[block]]")


# ----------------------------------------------------------------------------- measured on an experiment


def test_the_default_experiment_is_picked_by_measurement_and_the_fragment_loads(tmp_path):
    config = train.load_config(DEFAULT, [*TINY, f"workdir={tmp_path}"])
    pick = train.pick_policy(config, steps=6, out=open(tmp_path / "out.txt", "w"))
    names = [r.measurement.name for r in pick.rows]
    assert names == list(precision.pick.DEFAULT_CANDIDATES)
    assert sum(r.verdict == "picked" for r in pick.rows) == 1 and pick.choice.name in names
    for row in pick.rows:
        m = row.measurement
        assert m.error is None or row.verdict == "failed", m.error
        if m.numerics != "dropped" and not m.error:
            assert m.steps == 6 and len(m.step_seconds) == 5 and m.state_bytes > 0 and m.peak_bytes > 0
    saved = json.loads((tmp_path / "policy_pick.json").read_text())
    assert saved["picked"] == pick.choice.name and len(saved["candidates"]) == len(names) and saved["steps"] == 6
    fragment = yaml.safe_load((tmp_path / "policy_pick.yaml").read_text())
    assert fragment["precision"]["policy"] == pick.choice.policy
    # The overrides it prints and the fragment merged into the file both load.
    assert train.load_config(DEFAULT, list(pick.overrides)).precision.policy == pick.choice.policy
    raw = yaml.safe_load(open(DEFAULT))
    raw["precision"].update(fragment["precision"])
    assert train.config.from_dict(raw).precision.policy == pick.choice.policy
    # The same measurements, leanest: a lean policy where one is within tolerance.
    leanest = precision.pick_policy([r.measurement for r in pick.rows], prefer="memory", tolerance=0.05)
    lean_ok = [r for r in precision.pick_policy([r.measurement for r in pick.rows], tolerance=0.05).rows
               if r.measurement.name.startswith("lean") and r.verdict in ("eligible", "picked")]
    assert lean_ok and leanest.choice.name.startswith("lean")


def test_a_planted_float16_overflow_is_never_picked_as_it_is(tmp_path, capsys):
    (tmp_path / "hot_model.py").write_text(HOT_MODEL)
    raw = {"workdir": str(tmp_path / "run"), "steps": 100, "model": {"name": f"{tmp_path}/hot_model.py:HotMLP"},
           "data": {"name": "digits", "batch_size": 32, "eval_batch_size": 128, "eval_batches": 1},
           "precision": {"policy": "mixed_f16"}, "compile_cache": None, "progress": False, "inference_dtypes": []}
    path = tmp_path / "hot.yaml"
    path.write_text(yaml.safe_dump(raw))
    code = main([str(path), "--pick-policy", "--candidates", "mixed_bf16;mixed_f16", "--steps", "6"])
    out = capsys.readouterr().out
    assert code == 0, out
    saved = json.loads((tmp_path / "run" / "policy_pick.json").read_text())
    f16 = next(c for c in saved["candidates"] if c["name"] == "mixed_f16")
    # Its steps went non-finite; the doctor's verified rule is now part of the candidate, measured again.
    assert f16["numerics"] == "fixed" and f16["settings"]["rules"][0] == ["block", "f32"]
    assert f16["numerics_note"].startswith("the loss after 6 steps is nan; mul in block (forward) first went")
    assert f16["skipped_steps"] == 0 and abs(f16["loss_change"]) < 0.01
    chosen = saved["precision"]
    assert not (precision.get_policy(chosen["policy"]).compute_dtype == "float16" and "rules" not in chosen)
    assert f"picked: {saved['picked']} -> {shlex.join(saved['overrides'])}" in out
    assert train.load_config(path, saved["overrides"]).precision.policy == chosen["policy"]
    # Where it wins (float32 made slower here), its rule is in the table's command line and the fragment, and loads.
    rows = [Measurement(**{k: c[k] for k in FIELDS}) for c in saved["candidates"]
            if c["name"] in ("fp32", "mixed_f16")]
    rows[0] = dataclasses.replace(rows[0], step_seconds=tuple(10 * t + 1 for t in rows[0].step_seconds))
    pick = precision.pick_policy(rows)
    assert pick.choice.name == "mixed_f16" and pick.overrides[1].startswith("precision.rules=[[block, f32]")
    assert "'precision.rules=[[block, f32]," in pick.table()
    loaded = train.load_config(path, list(pick.overrides)).precision
    assert loaded.policy == "mixed_f16" and loaded.rules[0] == ["block", "f32"]
    assert yaml.safe_load(pick.fragment)["precision"]["rules"][0] == ["block", "f32"]


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("args, code, message", [
    (["--candidates", "fp32;mixed_f61"], 2, "error: --candidates: Invalid precision policy 'mixed_f61'"),
    (["--tolerance", "2"], 2, "error: --tolerance must be a number in (0, 1)"),
    (["--steps", "0"], 2, "error: --steps must be an integer >= 1"),
    (["model.init_from={d}/nothing"], 2, "error: the command line (model.init_from={d}/nothing): model.init_from: "),
])
def test_bad_input_is_one_line(args, code, message, tmp_path, capsys):
    args = [a.replace("{d}", str(tmp_path)) for a in args]
    steps = [] if "--steps" in args else ["--steps", "2"]
    assert main([DEFAULT, *TINY, f"workdir={tmp_path}/run", *args, "--pick-policy", *steps]) == code
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith(message.replace("{d}", str(tmp_path))), err


def test_picking_options_without_pick_policy_are_one_line(capsys):
    assert main([DEFAULT, "--candidates", "fp32"]) == 2
    assert capsys.readouterr().err.strip() == "error: --candidates goes with --pick-policy"
