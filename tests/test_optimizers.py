"""The optimizer as users train with it: SGD, AdamW or Adafactor (entries of one registry), each with its own
defaults and state, in a fused, foreach or for-loop implementation, and a fused optimizer's skipped fp16 steps
followed on the device."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from ampbench import config, data, results, runplan
from ampbench.config import optim
from ampbench.errors import ConfigError
from ampbench.measure import memory
from ampbench.report import figures, safety
from ampbench.report import memory as report_memory
from ampbench.train import runner, schedule, setup, step
from ampbench.train.policy import PrecisionPolicy
from tests.conftest import overflow_at


@pytest.fixture(autouse=True)
def _no_profile(tiny_params):
    """The step profile after training is not what these tests check (test_profile does): its steps left out."""
    tiny_params["profile"]["steps"] = 0


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory):
    out = tmp_path_factory.mktemp("prepared")
    data.prepare(config.DataConfig(source="synthetic", train_size=64, test_size=32), 0, out, out / "raw")
    return data.load_prepared(out, "cpu")


def test_adamw_gets_its_own_defaults_and_an_sgd_learning_rate_is_refused():
    cfg = config.from_dict({"train": {"optimizer": "adamw"}})
    assert (cfg.train.lr, cfg.train.weight_decay, cfg.train.betas) == (1e-3, 0.05, (0.9, 0.999))
    assert config.from_dict({}).train.lr == 0.1  # SGD's, as before
    with pytest.raises(ConfigError, match=r"train.lr = 0.1 is an SGD learning rate; .*set train.lr to about 0.001"):
        config.from_dict({"train": {"optimizer": "adamw", "lr": 0.1}})
    with pytest.raises(ConfigError, match=r"train.betas = \[0.9\] has 1 values; give exactly 2"):
        config.from_dict({"train": {"optimizer": "adamw", "betas": [0.9]}})
    assert config.from_dict({"train": {"optimizer": "adamw", "betas": [0.9, 0.9]}}).train.betas == (0.9, 0.9)
    with pytest.raises(ConfigError, match="optimizer_impl = 'fast' is not allowed; choose one of"):
        config.from_dict({"variants": {"a": {"precision": "fp16", "optimizer_impl": "fast"}}})


def test_the_plan_resolves_the_implementation_per_variant_and_device(tmp_path):
    cfg = config.from_dict({"train": {"optimizer": "adamw"},
                            "variants": {"fp32": {"precision": "fp32"},
                                         "loop": {"precision": "fp32", "optimizer_impl": "for_loop"}}})
    assert runplan.make_plan(cfg, "fp32", "cpu").train.optimizer_impl == "foreach"
    assert runplan.make_plan(cfg, "fp32", "cuda").train.optimizer_impl == "fused"
    assert runplan.make_plan(cfg, "loop", "cuda").train.optimizer_impl == "for_loop"
    plan = runplan.make_plan(cfg, "loop", "cpu")
    runplan.write_plan(plan, tmp_path / "p.json")
    assert runplan.read_plan(tmp_path / "p.json") == plan  # betas come back as the tuple they were
    for impl, flags in (("fused", (True, None)), ("foreach", (None, True)), ("for_loop", (None, False))):
        opt = setup.optimizer(plan, nn.Linear(2, 2).parameters(), impl)
        assert isinstance(opt, torch.optim.AdamW) and (opt.defaults["fused"], opt.defaults["foreach"]) == flags
        assert opt.defaults["weight_decay"] == 0.05 and opt.defaults["betas"] == (0.9, 0.999)


@pytest.mark.parametrize("name", optim.names())
def test_each_registered_optimizer_keeps_the_state_its_entry_says(name):
    """The memory model (data placement, before anything is built) reads the registry's state per parameter shape:
    it equals what torch's optimizer holds after a step, for a conv, a Linear, a BatchNorm and their biases."""
    train = config.from_dict({"train": {"optimizer": name}}).train
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.Flatten(), nn.Linear(8 * 4 * 4, 10))
    opt = optim.info(name).make(model.parameters(), train, "foreach")
    model(torch.randn(2, 3, 6, 6)).sum().backward()
    opt.step()
    shapes = [tuple(p.shape) for p in model.parameters()]
    assert optim.state_bytes(name, shapes, train) == memory.optimizer_state_bytes(opt) > 0
    assert optim.training_bytes(shapes, train) == 8 * sum(p.numel() for p in model.parameters()) \
        + memory.optimizer_state_bytes(opt)


def test_adafactor_is_one_entry_with_its_own_defaults_and_implementations():
    cfg = config.from_dict({"train": {"optimizer": "adafactor"}})
    assert (cfg.train.lr, cfg.train.weight_decay) == (1e-2, 0.01)
    opt = setup.optimizer(runplan.make_plan(cfg, "amp", "cuda"), nn.Linear(4, 2).parameters(), "foreach")
    assert isinstance(opt, torch.optim.Adafactor) and opt.defaults["weight_decay"] == 0.01
    assert runplan.make_plan(cfg, "fp32", "cuda").train.optimizer_impl == "foreach"  # torch has no fused Adafactor
    with pytest.raises(ConfigError, match=r"train.optimizer_impl = 'fused' does not exist for train.optimizer = "
                                          r"'adafactor'; choose one of foreach \| for_loop, or auto"):
        config.from_dict({"train": {"optimizer": "adafactor", "optimizer_impl": "fused"}})
    with pytest.raises(ConfigError, match=r"train.lr = 0.1 is an SGD learning rate; Adafactor diverges at it"):
        config.from_dict({"train": {"optimizer": "adafactor", "lr": 0.1}})


def test_auto_runs_fused_on_cuda_where_the_optimizer_has_a_kernel_that_skips_cleanly(monkeypatch):
    """auto: fused on CUDA where torch has it and its kernel skips GradScaler's overflowing step cleanly (SGD's, once
    its momentum is zeroed before the first step; AdamW's), foreach where torch has no fused form (Adafactor), and
    foreach under a scaler for an entry whose fused kernel could not skip cleanly."""
    import dataclasses
    sgd = config.from_dict({})
    assert runplan.make_plan(sgd, "amp", "cuda").train.optimizer_impl == "fused"
    assert runplan.make_plan(sgd, "amp", "cpu").train.optimizer_impl == "foreach"
    adamw = config.from_dict({"train": {"optimizer": "adamw"}})
    assert runplan.make_plan(adamw, "amp", "cuda").train.optimizer_impl == "fused"
    unsafe = dataclasses.replace(optim.info("sgd"), fused_skips_cleanly=False)
    monkeypatch.setitem(optim.REGISTRY, "sgd", unsafe)
    assert runplan.make_plan(sgd, "amp", "cuda").train.optimizer_impl == "foreach"
    assert runplan.make_plan(sgd, "fp32", "cuda").train.optimizer_impl == "fused"  # no scaler: nothing to skip
    assert runplan.for_precision(sgd, "fp16", "cuda").train.optimizer_impl == "foreach"


def test_adafactor_trains_in_fp16_through_the_runner(tiny_params, tiny_data):
    tiny_params["train"].update(epochs=2, optimizer="adafactor")
    del tiny_params["train"]["lr"], tiny_params["train"]["weight_decay"]  # Adafactor's own
    result = runner.train(runplan.make_plan(config.from_dict(tiny_params), "amp", "cpu"), tiny_data, progress=False)
    m = result.metrics
    assert m["optimizer"] == "adafactor" and m["optimizer_impl"] == "foreach" and "rows + columns" in \
        m["optimizer_state_kept"]
    assert math.isfinite(m["final_loss"]) and m["skipped_steps"] == 0
    assert result.history[-1]["train_loss"] < result.history[0]["train_loss"] + 0.5


@pytest.mark.filterwarnings("ignore:Detected call of")  # LambdaLR's optimizer never steps here
def test_the_host_schedule_gives_lambdalrs_rates_and_resumes_from_its_checkpoint():
    """The host schedule's table gives, step by step, the rates LambdaLR(lr_lambda) gives (the reference), past
    the last step too; its state, or LambdaLR's, resumes it at the same rate."""
    groups = [{"params": [nn.Parameter(torch.zeros(1))], "lr": 0.4}, {"params": [nn.Parameter(torch.zeros(1))]}]
    ref_opt = torch.optim.SGD([dict(g) for g in groups], lr=0.1)
    ref = torch.optim.lr_scheduler.LambdaLR(ref_opt, schedule.lr_lambda(60))
    host = schedule.HostSchedule(torch.optim.SGD([dict(g) for g in groups], lr=0.1), 60)
    for i in range(65):
        assert host.get_last_lr() == pytest.approx(ref.get_last_lr(), rel=1e-12, abs=0), i
        ref.step()
        host.step()
    for state in (host.state_dict(), ref.state_dict()):
        again = schedule.HostSchedule(torch.optim.SGD([dict(g) for g in groups], lr=0.1), 60)
        again.load_state_dict(state)
        assert again.get_last_lr() == host.get_last_lr() and again.taken == 65


@pytest.mark.filterwarnings("ignore:Detected call of")  # the host schedule's optimizer never steps here
def test_the_device_schedule_follows_the_steps_taken_as_the_host_schedule_does():
    """Fed each step's found-inf flag, the device schedule gives the LR LambdaLR gives when stepped on the steps
    taken only, without a sync."""
    lin = nn.Linear(2, 2)
    dev_opt = torch.optim.SGD(lin.parameters(), lr=0.4, fused=True)
    host_opt = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.4)
    dev, host = schedule.DeviceSchedule(dev_opt, 60), schedule.schedule(host_opt, 60)
    assert dev.get_last_lr() == pytest.approx(host.get_last_lr())
    for i in range(60):
        skipped = i in (1, 2, 40)
        dev.step(torch.tensor(float(skipped)))
        if not skipped:
            host.step()
        assert dev.get_last_lr() == pytest.approx(host.get_last_lr(), rel=1e-6, abs=1e-9), i
    state = dev.state_dict()
    opt = torch.optim.SGD(lin.parameters(), lr=0.4, fused=True)
    again = schedule.DeviceSchedule(opt, 60)
    opt.load_state_dict(dev_opt.state_dict())  # a resume: the optimizer's saved lr tensors, then the schedule's
    again.load_state_dict(state)
    assert state == {"taken": 57} and again.get_last_lr() == pytest.approx(host.get_last_lr(), rel=1e-6)
    again.step(torch.tensor(0.0))  # a step after the resume: written into the lr tensor the optimizer now holds
    host.step()
    assert again.rates[0]._base is opt.param_groups[0]["lr"] and opt.param_groups[0]["lr"].item() == \
        pytest.approx(host.get_last_lr()[0], rel=1e-6)


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_a_fused_optimizer_under_fp16_skips_and_schedules_as_foreach_does(tiny_params, tiny_data, monkeypatch,
                                                                        optimizer):
    """One overflow on the third of six steps: the fused run (its skip known only on the device, settled at the
    loop's syncs) counts the same skipped step, scale history and learning rates as the foreach run, and trains
    the same weights."""
    lr = 0.1 if optimizer == "sgd" else 0.001
    tiny_params["train"].update(epochs=3, optimizer=optimizer, lr=lr)
    results = {}
    for impl in ("foreach", "fused"):
        tiny_params["variants"]["amp"]["optimizer_impl"] = impl
        plan = runplan.make_plan(config.from_dict(tiny_params), "amp", "cpu")
        overflow_at(monkeypatch, 3)
        results[impl] = runner.train(plan, tiny_data, progress=False)
        monkeypatch.undo()
    fused, foreach = results["fused"], results["foreach"]
    assert fused.metrics["optimizer_impl"] == "fused" and fused.metrics["optimizer"] == optimizer
    assert fused.metrics["skipped_steps"] == foreach.metrics["skipped_steps"] == 1
    assert fused.scale_history == foreach.scale_history == [{"step": 0, "scale": 8192.0, "skipped": False},
                                                            {"step": 3, "scale": 4096.0, "skipped": True}]
    assert [r["lr"] for r in fused.history] == pytest.approx([r["lr"] for r in foreach.history], rel=1e-5)
    assert fused.metrics["final_loss"] == pytest.approx(foreach.metrics["final_loss"], rel=1e-3)
    assert math.isfinite(fused.metrics["final_loss"])


def test_the_report_says_when_optimizer_state_outweighs_the_activations_saved():
    summary = {"baseline": "fp32", "variants": {
        "fp32": {"activation_bytes": 4000, "micro_batch_size": 32, "optimizer_state_bytes": 2000},
        "amp": {"activation_bytes": 3000, "micro_batch_size": 32, "optimizer_state_bytes": 2000,
                "optimizer": "adamw"},
        "amp_accum": {"activation_bytes": 250, "micro_batch_size": 8, "optimizer_state_bytes": 500}}}
    lines = report_memory._optimizer_state_outweighs(summary)
    assert len(lines) == 2 and lines[0].startswith("amp: its optimizer state (adamw, ")
    assert "outweighs the activations it saves against fp32" in lines[0]  # amp_accum saves 750 > 500: no line


def _clipped_update(precision: str, micro: int, clip: float, n: int = 32, model=None):
    """One train_step of a BatchNorm-free model (SGD, lr 1, no momentum: the update is minus the clipped
    gradient); the update and the norm recorded before clipping."""
    torch.manual_seed(0)
    model = model or nn.Sequential(nn.Flatten(), nn.Linear(3 * 8 * 8, 64), nn.ReLU(), nn.Linear(64, 10))
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(n, 3, 8, 8, generator=g), torch.randint(0, 10, (n,), generator=g)
    policy = PrecisionPolicy(precision, "cpu", config.AmpConfig(init_scale=8192.0) if precision == "fp16" else None)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    before = [p.detach().clone() for p in model.parameters()]
    norms: list = []
    step.train_step(model, opt, policy.scaler(), policy, x, y, micro, clip=clip, norms=norms)
    return [p.detach() - b for p, b in zip(model.parameters(), before, strict=True)], float(norms[0])


def _rel(a, b) -> float:
    return max(((u - v).abs().max() / v.abs().max()).item() for u, v in zip(a, b, strict=True))


def test_fp16_clips_the_unscaled_gradients_as_fp32_does():
    """The update fp16 makes with clipping equals fp32's: the norm is the unscaled gradients' (clipping the
    scaled ones would clip at max_norm x 8192 and leave the update 8192x too small)."""
    fp32, norm32 = _clipped_update("fp32", 32, clip=0.05)
    fp16, norm16 = _clipped_update("fp16", 32, clip=0.05)
    # fp16's rounding bound: a sum of K fp16 products, accumulated in fp16 as some CPUs' kernels do (an AVX512-FP16
    # Xeon: 2% here), is within K x fp16's unit roundoff (2^-11), K the longest reduction: the first layer's 192
    # inputs. Clipping the scaled gradients would be off by the scale, 8192x.
    fp16_bound = 3 * 8 * 8 * 2.0 ** -11
    assert norm32 > 0.05 * 2  # clipping is active
    assert norm16 == pytest.approx(norm32, rel=fp16_bound)
    total = math.sqrt(sum(float(u.pow(2).sum()) for u in fp16))
    diff = math.sqrt(sum(float((u - v).pow(2).sum()) for u, v in zip(fp16, fp32, strict=True)))
    assert total == pytest.approx(0.05, rel=1e-3) and diff / 0.05 < fp16_bound
    _, unclipped = _clipped_update("fp32", 32, clip=0.0)  # norms without clipping: the same norm, no clip
    assert unclipped == pytest.approx(norm32, rel=1e-6)


def test_accumulation_clips_once_the_full_batch_gradient():
    full, norm_full = _clipped_update("fp32", 32, clip=0.05)
    accum, norm_accum = _clipped_update("fp32", 8, clip=0.05)
    # the same sums in another order: within fp32's K x 2^-24, K the longest reduction (192 inputs and 32 images)
    bound = (3 * 8 * 8 + 32) * 2.0 ** -24
    assert norm_accum == pytest.approx(norm_full, rel=bound) and _rel(accum, full) < bound


def test_clipping_and_the_norms_reach_the_run_files(tiny_params, tiny_data, tmp_path):
    tiny_params["train"].update(epochs=2, clip_grad_norm=0.5)
    result = runner.train(runplan.make_plan(config.from_dict(tiny_params), "amp", "cpu"), tiny_data,
                          progress=False)
    assert [r["step"] for r in result.grad_norms] == [1, 2, 3, 4]
    assert all(math.isfinite(r["grad_norm"]) and r["grad_norm"] > 0 for r in result.grad_norms)
    assert result.metrics["clip_grad_norm"] == 0.5 and result.metrics["grad_norm_logged"] is True
    results.write_run(tmp_path, result.metrics, result.tables(), result.step_times_ms)
    run = results.read_run(tmp_path)
    stats = safety.grad_norm_stats(run)
    assert stats["steps"] == 4 and stats["clip"] == 0.5
    lines = safety._grad_norms("amp", {"amp": run})
    assert lines[2].startswith("| variant | steps | median") and lines[4].startswith("| amp | 4 |")
    assert figures.grad_norm({"amp": run}, tmp_path / "g.png").is_file()


_FOREACH_RUNS = {}  # optimizer -> its foreach run of the test below (module-scoped data, the same params)


@pytest.mark.parametrize(("name", "impl"), [(n, i) for n in optim.names() for i in optim.info(n).impls])
def test_an_overflow_at_the_first_step_leaves_every_optimizer_as_foreach_leaves_it(tiny_params, tiny_data,
                                                                                   monkeypatch, name, impl):
    """GradScaler skips an overflowing first step; a fused kernel is handed the skip on the device. SGD's fused
    kernel would leave the momentum buffer its first step allocates uninitialised (NaN by the end, or a wrong
    momentum): zeroed before the first step, every implementation trains the same weights as foreach (the fused
    ones on the CPU's fused kernels)."""
    tiny_params["train"].update(epochs=2, optimizer=name)
    del tiny_params["train"]["lr"], tiny_params["train"]["weight_decay"]  # the optimizer's own
    out = {}
    for which in dict.fromkeys(("foreach", impl)):
        if which == "foreach" and name in _FOREACH_RUNS:  # the same run for every implementation of the optimizer
            out[which] = _FOREACH_RUNS[name]
            continue
        tiny_params["variants"]["amp"]["optimizer_impl"] = which
        overflow_at(monkeypatch, 1)
        out[which] = runner.train(runplan.make_plan(config.from_dict(tiny_params), "amp", "cpu"), tiny_data,
                                  progress=False)
        monkeypatch.undo()
    _FOREACH_RUNS.setdefault(name, out["foreach"])
    got, ref = out[impl], out["foreach"]
    assert got.metrics["optimizer_impl"] == impl and got.metrics["skipped_steps"] == 1
    assert math.isfinite(got.metrics["final_loss"]) and math.isfinite(got.history[-1]["eval_loss"])
    assert got.metrics["final_loss"] == pytest.approx(ref.metrics["final_loss"], rel=1e-3)
    assert got.history[-1]["eval_loss"] == pytest.approx(ref.history[-1]["eval_loss"], rel=1e-3)


def test_fused_sgd_never_reads_memory_its_skipped_first_step_left_unwritten(monkeypatch):
    """Deterministic form of the above: uninitialised memory made NaN (``torch.empty_like`` patched), a first step
    GradScaler skips, then a step taken: the fused SGD's weights equal foreach's, finite."""
    train = config.from_dict({}).train  # SGD, momentum 0.9, Nesterov
    real_empty_like = torch.empty_like
    monkeypatch.setattr(torch, "empty_like", lambda t, **kw: real_empty_like(t, **kw).fill_(float("nan")))
    weights = {}
    for impl in ("foreach", "fused"):
        torch.manual_seed(0)
        model = nn.Linear(4, 2)
        opt = optim.info("sgd").make(model.parameters(), train, impl)
        scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
        for skipped in (True, False):
            opt.zero_grad()
            scaler.scale(model(torch.ones(3, 4)).sum()).backward()
            if skipped:
                model.weight.grad[0, 0] = float("inf")
            scaler.step(opt)
            scaler.update()
        weights[impl] = torch.cat([p.detach().flatten() for p in model.parameters()])
    assert torch.isfinite(weights["fused"]).all()
    assert torch.allclose(weights["fused"], weights["foreach"])
