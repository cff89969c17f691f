"""The step profile: op categories, dtypes, staying out of the timed steps; time to accuracy; the report's why."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from ampbench import config, data, report, results, runplan
from ampbench.report import summary as report_summary
from ampbench.sandbox import merge
from ampbench.train import profiling, runner, step
from tests.conftest import SHRINK, verdict_of


@pytest.mark.parametrize(("name", "scopes", "category"), [
    ("aten::mkldnn_convolution", ["aten::conv2d"], "conv/matmul"),
    ("aten::convolution_backward", ["autograd::engine::evaluate_function: ConvolutionBackward0"], "conv/matmul"),
    ("aten::addmm", ["aten::linear"], "conv/matmul"),
    ("aten::mm", [], "conv/matmul"),
    ("aten::_scaled_mm", ["aten::mm"], "conv/matmul"),  # fp8's GEMM, under torchao's float8 tensor's mm
    ("aten::_scaled_dot_product_flash_attention_for_cpu", [], "conv/matmul"),
    ("aten::native_batch_norm", ["aten::batch_norm"], "normalization"),
    ("aten::native_layer_norm_backward", [], "normalization"),
    ("aten::_log_softmax", ["aten::cross_entropy_loss"], "softmax/reductions"),
    ("aten::sum", [], "softmax/reductions"),
    ("aten::_to_copy", ["aten::to"], "casts"),
    ("aten::copy_", ["aten::_to_copy"], "casts"),
    ("aten::clamp_min", ["aten::relu"], "elementwise/activations"),
    ("aten::gelu_backward", [], "elementwise/activations"),
    ("aten::_foreach_add_", ["Optimizer.step#SGD.step"], "optimizer"),
    ("aten::_amp_foreach_non_finite_check_and_unscale_", ["Optimizer.step#SGD.step"], "loss scaling"),
    ("aten::_amp_update_scale_", [], "loss scaling"),
    ("aten::index_select", ["ampbench::data"], "data preparation"),
    ("aten::empty", [], "other"),
    ("gloo:all_reduce", [], "communication"),
    ("nccl:all_reduce", ["DistributedDataParallel.forward"], "communication"),
    ("c10d::allreduce_", [], "communication"),
    ("c10d::broadcast_", ["DistributedDataParallel.forward"], "communication"),
    ("record_param_comms", [], "communication"),
    ("ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)", [], "communication"),
    ("aten::broadcast_tensors", [], "other"),  # not a collective, whatever its name
])
def test_ops_fall_into_their_category(name, scopes, category):
    assert profiling.categorize(name, scopes) == category


def mlp(num_classes):
    """A model whose op mix is known: two matmuls, a LayerNorm, a GELU; no convolution, no BatchNorm."""
    return nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, 512), nn.LayerNorm(512), nn.GELU(),
                         nn.Linear(512, num_classes))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    out = tmp_path_factory.mktemp("prepared")
    data.prepare(config.DataConfig(source="synthetic", train_size=96, test_size=32), 0, out, out / "raw")
    return data.load_prepared(out, "cpu")


def _plan(variant: str, steps: int = 2, **model):
    params = merge(config.to_dict(config.Config()), SHRINK)
    params["model"] = {**params["model"], **model}
    params["profile"] = {"steps": steps}
    return runplan.make_plan(config.from_dict(params), variant, "cpu")


def test_profile_of_a_known_op_mix(tiny):
    result = runner.train(_plan("amp", factory="tests.test_profile:mlp", input_size=0), tiny, progress=False)
    prof = result.metrics["profile"]
    cats = prof["categories"]
    assert prof["steps"] == 2 and prof["basis"] == "CPU time of each op"
    assert {"conv/matmul", "normalization", "elementwise/activations", "optimizer", "data preparation"} <= set(cats)
    assert cats["conv/matmul"]["dtypes"].startswith("fp16")  # autocast runs the matmuls in fp16
    assert cats["normalization"]["dtypes"]                    # LayerNorm's input dtype is recorded too
    assert cats["casts"]["ms_per_step"] > 0                   # the casts autocast adds
    assert "loss scaling" in cats                             # the GradScaler's unscale and update
    assert abs(sum(c["ms_per_step"] for c in cats.values()) - prof["attributed_ms_per_step"]) < 1e-6
    assert 0.5 < prof["attributed_ms_per_step"] / prof["wall_ms_per_step"] <= 1.05
    trace = json.loads(result.profile_trace)
    assert any(e.get("name") == profiling.DATA_SCOPE for e in trace["traceEvents"])  # a Perfetto-readable trace


def test_profile_never_runs_inside_the_timed_steps(tiny, monkeypatch):
    real, calls = step.train_step, []

    def watched(*args, **kwargs):
        calls.append(torch._C._autograd._profiler_enabled())
        return real(*args, **kwargs)

    monkeypatch.setattr(step, "train_step", watched)
    result = runner.train(_plan("fp32", steps=3), tiny, progress=False)
    trained = result.metrics["optimizer_steps"]
    assert calls[:trained] == [False] * trained  # every training step, timed or warm-up, ran unprofiled
    # then one warm step and the profiler's own warm-up (prepared, not yet recording), then the profiled steps
    assert calls[trained:] == [False] * (1 + profiling.WARMUP) + [True] * 3
    assert result.metrics["timed_steps"] == trained - result.metrics["warmup_steps"]


def test_profile_off(tiny):
    result = runner.train(_plan("fp32", steps=0), tiny, progress=False)
    assert "profile" not in result.metrics and result.profile_trace == ""


def test_time_to_accuracy_from_a_known_history():
    history = [{"epoch": 1, "epoch_time_s": "2.0", "eval_acc": "0.5"},
               {"epoch": 2, "epoch_time_s": "3.0", "eval_acc": "0.91"},
               {"epoch": 3, "epoch_time_s": "3.0", "eval_acc": "0.95"}]
    assert report_summary.time_to_accuracy(history, 0.9) == (5.0, 2)
    assert report_summary.time_to_accuracy(history, 0.95) == (8.0, 3)
    assert report_summary.time_to_accuracy(history, 0.99) is None


def _profile(conv, norm, casts, wall):
    cats = {"conv/matmul": {"ms_per_step": conv, "share": conv / wall, "dtypes": "fp16 100%"},
            "normalization": {"ms_per_step": norm, "share": norm / wall, "dtypes": "fp32 100%"}}
    if casts:
        cats["casts"] = {"ms_per_step": casts, "share": casts / wall, "dtypes": "fp16 50%, fp32 50%"}
    return {"steps": 3, "basis": "CUDA kernel time", "wall_ms_per_step": wall, "categories": cats,
            "category_order": list(profiling.CATEGORIES), "category_roles": dict(profiling.ROLES),
            "attributed_ms_per_step": conv + norm + casts, "gpu_busy_fraction": 0.8, "kernels_per_step": 120,
            "cost_s": 1.5}


def _write(runs, name, precision, step_ms, prof, accs):
    metrics = {"variant": name, "precision": precision, "accum_steps": 1, "batch_size": 256, "epochs": len(accs),
               "imgs_per_s": 256 / step_ms * 1000, "epoch_time_s": 10.0,
               "step_time_ms": {"median": step_ms, "p10": step_ms * 0.9, "p90": step_ms * 1.1, "n": 5},
               "imgs_per_s_p10_p90": [256 / (step_ms * 1.1) * 1000, 256 / (step_ms * 0.9) * 1000],
               "peak_mem_bytes": 100, "activation_bytes": 10, "final_acc": accs[-1], "best_acc": max(accs),
               "skipped_steps": 0, "tf32": {"matmul_fp32_precision": "ieee"}, "arch": "resnet18", "profile": prof,
               "peak_tflops_datasheet": {"fp32": 67.0, "fp16": 989.4}[precision]}
    history = [{"epoch": i + 1, "train_loss": 1.0, "eval_loss": 1.0, "eval_acc": a, "epoch_time_s": step_ms / 10}
               for i, a in enumerate(accs)]
    results.write_run(runs / name, metrics, {"history": history}, [step_ms * (1 + 0.01 * i) for i in range(20)])


def test_report_explains_from_the_profile(tmp_path):
    runs = tmp_path / "runs"
    _write(runs, "fp32", "fp32", 100.0, _profile(60.0, 20.0, 0.0, 100.0), [0.5, 0.8, 0.9])
    _write(runs, "amp", "fp16", 50.0, _profile(15.0, 20.0, 5.0, 50.0), [0.6, 0.9, 0.92])
    env = {"torch": "2.x", "gpu": {"name": "NVIDIA H200", "capability": "9.0", "tensor_cores": True,
                                   "bf16_supported": True}}
    s = report.build(runs, env, tmp_path / "r.md", tmp_path / "s.json", tmp_path / "fig", ["fp32", "amp"],
                     target_acc=0.9)
    cmp = s["profile_comparison"]["amp"]
    assert cmp["categories"]["conv/matmul"]["speedup"] == pytest.approx(4.0)
    assert cmp["categories"]["normalization"]["speedup"] == pytest.approx(1.0)
    assert cmp["tensor_core_share"] == pytest.approx(0.6) and cmp["amdahl_bound"] == pytest.approx(2.5)
    assert cmp["amdahl_bound_at_peak"] == pytest.approx(1 / (0.4 + 0.6 / (989.4 / 67.0)))
    amp = s["variants"]["amp"]
    assert (amp["time_to_target_s"], amp["time_to_target_epoch"]) == (pytest.approx(10.0), 2)
    assert s["variants"]["fp32"]["time_to_target_s"] == pytest.approx(30.0)
    md = (tmp_path / "r.md").read_text()
    verdict = verdict_of(md)
    assert "conv/matmul 4.00x faster (60 -> 15 ms)" in verdict and "normalization 1.00x faster" in verdict
    assert "at most 2.50x faster (an Amdahl bound" in verdict and "amp added 5 ms of casts" in verdict
    assert "## Why: the step profile" in md and "| conv/matmul | 60 ms (60%; fp16 100%)" in md
    assert "GPU sat idle" in md and "20%" in md and "profile_trace.json" in md
    assert "| amp | 10.0 s | 2 | 3.00x |" in md
    assert "nothing about process-to-process variation" in md and "within one run" in verdict
    assert "not enough to call it faster or slower" in verdict  # one run, no paired check: no claim
    assert (tmp_path / "fig" / "profile.png").is_file()


def test_cuda_summary_counts_kernels_and_busy_time():
    """On CUDA each op's time is its kernels' (self device) time; kernels alone give the GPU's busy share: not
    Kineto's gpu_user_annotation mirrors of record_function ranges, not memcpy/memset, overlaps counted once."""
    from types import SimpleNamespace as NS
    cpu, cuda = torch.autograd.DeviceType.CPU, torch.autograd.DeviceType.CUDA

    def op(name, device_us, parent=None, dtypes=("c10::Half",)):
        return NS(name=name, device_type=cpu, self_device_time_total=device_us, self_cpu_time_total=5.0,
                  cpu_parent=parent, input_dtypes=list(dtypes), activity_type="cpu_op")

    def device(name, start, end, kind):
        return NS(name=name, device_type=cuda, time_range=NS(start=start, end=end, elapsed_us=lambda: end - start),
                  cpu_parent=None, activity_type=kind, is_user_annotation=kind == "gpu_user_annotation")

    conv = op("aten::cudnn_convolution", 600.0)
    bn = op("aten::native_batch_norm", 200.0, dtypes=("float",))
    events = [conv, device("implicit_gemm", 0, 400, "kernel"), device("wgrad", 300, 500, "kernel"),  # overlap
              bn, device("bn_fw", 1000, 1200, "kernel"),
              device("ProfilerStep#3", 0, 2000, "gpu_user_annotation"),  # the step's range on the GPU timeline
              device("ampbench::data", 0, 100, "gpu_user_annotation"),
              device("Memcpy HtoD (Pageable -> Device)", 1500, 1900, "gpu_memcpy"),
              device("Memset (Device)", 1900, 1950, "gpu_memset")]
    s = profiling.summarize(events, steps=2, wall_ms=2.0, on_cuda=True)
    assert s["basis"] == "CUDA kernel time" and s["kernels_per_step"] == 1.5
    # busy: 0-500 (two overlapping kernels) and 1000-1200 = 700 us over 2 steps
    assert s["gpu_busy_ms_per_step"] == pytest.approx(0.35) and s["gpu_busy_fraction"] == pytest.approx(0.35)
    assert s["categories"]["conv/matmul"] == {"ms_per_step": pytest.approx(0.3), "share": pytest.approx(0.3),
                                              "dtypes": "fp16 100%"}
    assert s["categories"]["normalization"]["dtypes"] == "fp32 100%"


def test_busy_time_merges_overlapping_kernels():
    assert profiling.busy_us([(0, 10), (5, 15), (20, 30), (22, 25)]) == 25
    assert profiling.busy_us([]) == 0
