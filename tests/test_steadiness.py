"""A busy machine cannot fake a speedup: the steadiness guard, the paired check (drift lands on every precision
alike), and a verdict that claims faster or slower only from repeats or the paired check."""

from __future__ import annotations

import time

import pytest
import torch

from ampbench import config, data
from ampbench.measure import stats
from ampbench.report import summary, verdict
from ampbench.sweep import paired
from ampbench.train import step


def test_a_run_whose_second_half_ran_2x_slower_is_unsteady_and_a_steady_one_is_not():
    rng = torch.Generator().manual_seed(0)
    steady = (100 + 3 * torch.randn(60, generator=rng)).tolist()  # 3% noise, as a quiet GPU's fixed-shape steps
    assert stats.steadiness(steady)["unsteady"] == []
    slowed = steady[:30] + [2 * t for t in steady[30:]]
    st = stats.steadiness(slowed)
    assert st["drift"] == pytest.approx(2.0, rel=0.1) and len(st["unsteady"]) == 2  # spread and drift
    assert any("2.0" in u and "slower by the last third" in u for u in st["unsteady"])
    spiky = [100.0 if i % 3 else 250.0 for i in range(60)]  # a third of the steps 2.5x: another tenant's bursts
    assert stats.steadiness(spiky)["unsteady"] and stats.steadiness(spiky)["drift"] == pytest.approx(1.0)
    assert "SM clock moved" in stats.steadiness(steady, [1400.0, 1980.0])["unsteady"][0]
    assert stats.steadiness(steady, [1965.0, 1980.0])["unsteady"] == []
    assert stats.steadiness([1.0] * 5) is None  # too few steps to tell


def _run(name: str, prec: str, ms: list[float], imgs_per_s: float, repeats: list[float] | None = None) -> dict:
    m = {"variant": name, "precision": prec, "accum_steps": 1, "imgs_per_s": imgs_per_s, "epoch_time_s": 1.0,
         "peak_mem_bytes": 100, "activation_bytes": 10, "final_acc": 0.5, "step_time_ms": {"median": ms[0]}}
    if repeats:
        m["imgs_per_s_runs"] = repeats
    return {"metrics": m, "history": [], "step_times_ms": ms}


def _paired(ratios: list[float]) -> dict:
    return {"enabled": True, "device": "cuda", "batch": 256, "rounds": len(ratios), "steps": 5,
            "order": "rotated each round", "claim_rounds": 8, "margin": 0.02, "not_made": {}, "baseline": "fp32",
            "vs_fp32": {"amp": {"median": sorted(ratios)[len(ratios) // 2], "lo": min(ratios), "hi": max(ratios),
                                "rounds": ratios, "claim": paired.claim(ratios), "precision": "fp16"}}}


def _verdict(runs: dict, paired_json: dict | None = None) -> str:
    s = summary.summarize(runs, paired_json=paired_json)
    return verdict.verdict(s, {"gpu": {"name": "NVIDIA H100", "tensor_cores": True}})


def test_the_verdict_claims_a_speedup_from_repeats_or_the_paired_check_never_from_one_runs_interval():
    fp32, amp = [100.0] * 30, [50.0] * 30
    runs = {"fp32": _run("fp32", "fp32", fp32, 1000.0), "amp": _run("amp", "fp16", amp, 2000.0)}
    one = _verdict(runs)
    assert "ran 2.00x faster than strict FP32 (95% CI 2.00 to 2.00 within one run): one run each, not enough" in one
    assert "trained" not in one and "faster than FP32" not in one  # measured, not claimed
    claimed = _verdict(runs, _paired([1.9, 2.0, 2.1, 1.95, 2.05, 2.0, 1.98, 2.02]))
    assert "amp (FP16-AMP) trained 2.00x faster than strict FP32 in the paired check (8 rounds" in claimed
    assert "its stage ran 2.00x faster" in claimed and "disagree" not in claimed
    s = summary.summarize({**runs, "tf32": _run("tf32", "tf32", fp32, 1000.0)},
                          paired_json=_paired([1.9, 2.0, 2.1, 1.95, 2.05, 2.0, 1.98, 2.02]))
    ladder = verdict.ladder_sentence(s, {"gpu": {"name": "x"}})
    assert "amp (fp16) 2.00x faster than strict fp32 (paired check: 2.00x faster)" in ladder
    few = _verdict(runs, _paired([1.9, 2.0, 2.1, 1.95, 2.05, 2.0]))  # 6 rounds, all agreeing: 3% by chance
    assert "was no faster than FP32 in the paired check" in few and "8 rounds agreeing are needed" in few
    mixed = _verdict(runs, _paired([0.9, 1.1, 1.0, 1.05, 0.95, 1.0]))
    assert "was no faster than FP32 in the paired check (1.00x" in mixed
    # the busy machine: fp16 emulated on a CPU, its stage 6.4x fp32's because fp32's stage ran while another tenant
    # loaded the machine; the paired check, timed in turns, says 0.1x
    busy = {"fp32": _run("fp32", "fp32", [100.0] * 15 + [640.0] * 15, 100.0), "amp": _run("amp", "fp16", amp, 640.0)}
    said = _verdict(busy, _paired([0.09, 0.1, 0.11, 0.1, 0.1, 0.1, 0.1, 0.1]))
    assert said.startswith("On NVIDIA H100, amp (FP16-AMP) was 10.00x slower than FP32 in the paired check (8 rounds")
    assert "The two disagree: trust the paired check" in said
    assert "The machine was not steady while these ran (`fp32`: its step times spread" in said
    assert "no speedup is claimed from their stages" in said
    # repeats: the t-interval over them decides, as before
    reps = {"fp32": _run("fp32", "fp32", fp32, 1000.0, [1000.0, 1010.0, 990.0]),
            "amp": _run("amp", "fp16", amp, 2000.0, [2000.0, 1990.0, 2010.0])}
    assert "trained 2.00x faster (95% CI" in _verdict(reps) and "over repeats) than strict FP32" in _verdict(reps)
    reps["fp32"]["metrics"]["repeats"] = reps["amp"]["metrics"]["repeats"] = 2  # each repeat's steps judged alone
    reps["fp32"]["step_times_ms"] = [100.0] * 15 + [250.0] * 15 + [100.0] * 30  # the first repeat slowed
    shaky = _verdict(reps)
    assert "over repeats), but on a machine that was not steady: no claim from it" in shaky
    assert "trained" not in shaky  # measured faster, not claimed
    reps["fp32"]["step_times_ms"] = [100.0] * 30 + [250.0] * 30  # steady within each repeat: repeats' spread
    assert "trained 2.00x faster" in _verdict(reps)


def test_the_paired_check_is_not_fooled_by_a_machine_that_slows_down(tmp_path, monkeypatch):
    """A machine that gets slower with every step (another tenant ramping up), the steps themselves the same work:
    timing fp32 and then tf32 one after the other, as the stages run, makes tf32 look far slower; the paired check,
    its windows in turns, finds them equal."""
    data.prepare(config.DataConfig(source="synthetic", train_size=64, test_size=16), 0, tmp_path, tmp_path / "raw")
    prepared = data.load_prepared(tmp_path, "cpu")
    calls = []

    def slowing(*args, **kwargs):  # a step of fixed work on a machine that slows: 0.3 ms more each step
        calls.append(1)
        time.sleep(0.006 + 0.0003 * len(calls))
        return torch.tensor(1.0)

    seen = []  # each step's precision and the TF32 switch it ran under (the process's: set per window)

    def slowing_recorded(model, opt, scaler, policy, *args, **kwargs):
        seen.append((policy.precision, torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32))
        return slowing()

    monkeypatch.setattr(step, "train_step", slowing_recorded)
    cfg = config.from_dict({"device": "cpu", "model": {"arch": "small_cnn"}, "seed": 0,
                            "train": {"batch_size": 8, "augment": False},
                            "paired": {"rounds": 6, "steps": 2, "window_s": 0},
                            "variants": {"fp32": {"precision": "fp32"}, "tf32": {"precision": "tf32"}}})
    found = paired.run_paired(cfg, prepared, torch.device("cpu"))
    got = found["vs_fp32"]["tf32"]
    assert 0.8 < got["median"] < 1.25 and len(got["rounds"]) == 6 and got["claim"] is None
    # each window runs under its own variant's TF32 switch, though every bench was built before the rounds
    assert {(p, a, b) for p, a, b in seen} == {("fp32", False, False), ("tf32", True, True)}
    assert found["imgs_per_s"]["fp32"][0] > 1.5 * found["imgs_per_s"]["fp32"][-1]  # the machine did slow down
    # the same windows one precision after the other: the drift lands on tf32
    benches = {p: paired.Bench(cfg, prepared, torch.device("cpu"), p) for p in ("fp32", "tf32")}
    calls.clear()
    one_by_one = {p: [b.run(8, 2, warmup=1).imgs_per_s() for _ in range(6)] for p, b in benches.items()}
    assert sum(one_by_one["tf32"]) / sum(one_by_one["fp32"]) < 0.75


def test_the_paired_check_times_one_process_variants_of_one_step_s_work_the_strict_baseline_first():
    """Data-parallel and accumulating variants do other work per step than one process's: they are left out."""
    cfg = config.from_dict({"device": "cpu", "distributed": {"nproc_per_node": 2}, "variants": {
        "amp": {"precision": "fp16"}, "fp32": {"precision": "fp32"}, "bf16_1proc": {"precision": "bf16", "ddp": False},
        "fp32_1proc": {"precision": "fp32", "ddp": False}, "amp_accum": {"precision": "fp16", "accum_steps": 2,
                                                                        "ddp": False}}})
    assert paired.variants(cfg) == ["fp32_1proc", "bf16_1proc"]
    one = config.from_dict({"device": "cpu", "variants": {"amp": {"precision": "fp16"}, "fp32": {"precision": "fp32"},
                                                          "tf32": {"precision": "tf32"}}})
    assert paired.variants(one) == ["fp32", "amp", "tf32"]


def test_a_paired_check_that_fails_is_said_and_the_stage_still_writes_its_file(tmp_path, monkeypatch):
    """The paired check is an analysis: made to fail, the stage warns in one line, writes paired.json with why, and
    the report says it could not be made."""
    import json
    import sys

    from ampbench import errors, sandbox
    from ampbench.report import sections
    data.prepare(config.DataConfig(source="synthetic", train_size=16, test_size=8), 0, tmp_path / "p", tmp_path / "r")
    (tmp_path / "params.yaml").write_text("device: cpu\nmodel: {arch: small_cnn}\ntrain: {batch_size: 8}\n")
    (tmp_path / "env.json").write_text('{"torch": "x", "cuda_available": false, "cuda_runtime": null, "gpu": null}')
    import subprocess
    proc = subprocess.run([sys.executable, str(sandbox.REPO_ROOT / "stages" / "paired.py"), "--params",
                           str(tmp_path / "params.yaml"), "--data", str(tmp_path / "p"), "--env",
                           str(tmp_path / "env.json"), "--out", str(tmp_path / "paired.json")],
                          env={**sandbox.env_with_venv(), errors.FAIL_ON_PURPOSE: "paired"}, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "warning: the paired check could not be made for small_cnn" in proc.stdout
    found = json.loads((tmp_path / "paired.json").read_text())
    assert found["enabled"] and found["error"].startswith("RuntimeError: failed on purpose")
    lines = sections.steadiness({"variants": {}, "paired": found}, {}, {})
    assert any(line.startswith("The paired check could not be made (RuntimeError") for line in lines)


def test_paired_windows_are_sized_by_time_and_a_pair_of_the_same_arithmetic_claims_nothing(monkeypatch):
    """Each variant's windows hold paired.window_s seconds of its steps (at least paired.steps), sized once from a
    calibration window; tf32 on a CPU is fp32's arithmetic, so however its rounds fall the report claims nothing."""
    step_s = {"fp32": 0.005, "tf32": 0.0045, "fp16": 0.1}  # tf32 "faster" in every round: the rule would claim it
    timed: dict[str, list[int]] = {p: [] for p in step_s}

    class Clock:
        def __init__(self, rate):
            self.rate = rate

        def imgs_per_s(self):
            return self.rate

    class FakeBench:
        multiple = 1

        def __init__(self, cfg, data, device, precision, plan):
            self.plan, self.precision = plan, precision

        def batches(self, batch):
            return None

        def run(self, batch, n, feed, warmup):
            timed[self.precision].append(n)
            return Clock(batch / step_s[self.precision])

    monkeypatch.setattr(paired, "Bench", FakeBench)
    cfg = config.from_dict({"device": "cpu", "model": {"arch": "small_cnn"}, "train": {"batch_size": 8},
                            "paired": {"rounds": 8, "steps": 20, "window_s": 0.2},
                            "variants": {"fp32": {"precision": "fp32"}, "tf32": {"precision": "tf32"},
                                         "amp": {"precision": "fp16"}}})
    found = paired.run_paired(cfg, {"meta": {}}, torch.device("cpu"))
    assert found["steps"] == {"fp32": 40, "tf32": 45, "amp": 20}  # 0.2 s of each; fp16's 0.1 s steps: 20 at least
    assert timed["fp32"] == [1, paired.CALIBRATE] + [40] * 8 and timed["fp16"][2:] == [20] * 8
    tf32 = found["vs_fp32"]["tf32"]
    assert tf32["claim"] == "faster" and tf32["same_arithmetic"] and "same_arithmetic" not in found["vs_fp32"]["amp"]
    runs = {"fp32": _run("fp32", "fp32", [100.0] * 30, 1000.0), "tf32": _run("tf32", "tf32", [100.0] * 30, 1000.0)}
    said = summary.summarize(runs, paired_json=found)
    text = verdict.verdict(said, {"gpu": None})
    assert "tf32 (TF32) runs the same arithmetic as strict FP32 on this device" in text and "trained" not in text
    from ampbench.report import glance, sections
    assert glance.claim("tf32", said)[2] is None
    assert any(line.startswith("| tf32 |") and "| same arithmetic |" in line for line in glance.table(said))
    assert any("none: the same arithmetic as fp32 here" in line for line in sections.steadiness(said, {}, runs))
    assert paired.window_steps(0.0, 20, 0.2) == 20 and paired.window_steps(0.003, 5, 0.2) == 67
