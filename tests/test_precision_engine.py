"""The precision policy and the one training loop: a step per precision, accumulation, skipped steps."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ampbench import config, data, models, runplan
from ampbench.config import AmpConfig
from ampbench.errors import ConfigError, NonFiniteTraining
from ampbench.train import engine, ledger, runner, schedule, step
from ampbench.train.policy import PrecisionPolicy
from tests.conftest import overflow_at


def test_policy_per_precision():
    fp32, fp16, bf16 = (PrecisionPolicy(p, "cpu", AmpConfig()) for p in ("fp32", "fp16", "bf16"))
    lin = nn.Linear(4, 4)
    x = torch.randn(2, 4)
    for policy, dtype in ((fp32, torch.float32), (fp16, torch.float16), (bf16, torch.bfloat16)):
        with policy.autocast():
            assert lin(x).dtype == dtype
    assert fp16.scaler().is_enabled() and not fp32.scaler().is_enabled() and not bf16.scaler().is_enabled()


def test_scaler_takes_amp_params():
    scaler = PrecisionPolicy("fp16", "cpu", AmpConfig(init_scale=1024, growth_factor=4.0, backoff_factor=0.25,
                                                     growth_interval=7)).scaler()
    assert scaler.get_scale() == 1024
    assert (scaler.get_growth_factor(), scaler.get_backoff_factor(), scaler.get_growth_interval()) == (4.0, 0.25, 7)


def test_micro_batch_is_one_rule_for_the_params_and_the_trainer():
    assert config.micro_batch(256, 1, 4) == 64 and config.micro_batch(256, 2, 4) == 32
    with pytest.raises(ConfigError, match=r"variants.a.accum_steps = 3 does not divide train.batch_size = 256"):
        config.micro_batch(256, 1, 3, "a")
    with pytest.raises(ConfigError, match=r"train.batch_size = 36 does not split into distributed.nproc_per_node = "
                                          r"2 processes x accum_steps = 4 equal micro-batches; .* multiple of 8"):
        config.micro_batch(36, 2, 4)


def _grads(model, x, y, micro, policy):
    model.zero_grad(set_to_none=True)
    loss = step.accumulate_gradients(model, x, y, micro, policy, policy.scaler())
    return loss, [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("n", [32, 29])  # 29: a short last micro-batch still gives the full-batch gradient
def test_accumulated_gradients_equal_the_full_batch(n):
    torch.manual_seed(0)
    model = models.build(config.ModelConfig(arch="small_cnn", channels_last=False), num_classes=10,
                         image_size=32, device="cpu").eval()  # BN in eval: batch-independent
    x, y = torch.randn(n, 3, 32, 32), torch.randint(0, 10, (n,))
    policy = PrecisionPolicy("fp32", "cpu", None)
    full_loss, full = _grads(model, x, y, n, policy)
    acc_loss, acc = _grads(model, x, y, 8, policy)
    # The same sums in another order: fp32's rounding bound for a sum of K terms is K x its unit roundoff (2^-24),
    # K the loss's n images, and for the gradients the longest reduction, the first convolution's weight gradient
    # over n x 32 x 32 positions (a wrong weighting of a micro-batch is off by its share: percents)
    u = 2.0 ** -24
    assert torch.allclose(full_loss, acc_loss, rtol=n * u, atol=0)
    worst = max(((a - b).abs().max() / b.abs().max()).item() for a, b in zip(acc, full, strict=True))
    assert worst < n * 32 * 32 * u


def _plan(tiny_params, variant, **train):
    tiny_params["train"].update(train)
    return runplan.make_plan(config.from_dict(tiny_params), variant, "cpu")


@pytest.fixture(autouse=True)
def _no_profile(tiny_params):
    """The step profile after training is not what these tests check (test_profile does): its steps left out."""
    tiny_params["profile"]["steps"] = 0


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory):
    out = tmp_path_factory.mktemp("prepared")
    data.prepare(config.DataConfig(source="synthetic", train_size=64, test_size=32), 0, out, out / "raw")
    return data.load_prepared(out, "cpu")


@pytest.mark.parametrize("variant", ["fp32", "amp", "amp_accum", "bf16"])
def test_one_epoch_per_precision(tiny_params, tiny_data, variant):
    tiny_params["variants"]["bf16"] = {"precision": "bf16", "accum_steps": 2}
    plan = _plan(tiny_params, variant)
    result = runner.train(plan, tiny_data, progress=False)
    m = result.metrics
    assert m["variant"] == variant and m["optimizer_steps"] == 2 and m["timed_steps"] == 1
    assert m["micro_batch_size"] == 32 // plan.accum_steps
    assert torch.isfinite(torch.tensor(m["final_loss"])) and 0 <= m["final_acc"] <= 1
    assert m["imgs_per_s"] > 0 and m["activation_bytes"] > 0 and m["peak_mem_bytes"] > 0
    assert len(result.history) == 1 and len(result.step_times_ms) == 1
    if plan.precision == "fp16":
        assert m["final_loss_scale"] == 8192 and result.scale_history[0] == {"step": 0, "scale": 8192.0,
                                                                              "skipped": False}
    else:
        assert m["final_loss_scale"] is None and result.scale_history == []


def test_fp16_saves_activation_memory(tiny_params, tiny_data):
    fp32 = runner.train(_plan(tiny_params, "fp32"), tiny_data, progress=False).metrics
    amp = runner.train(_plan(tiny_params, "amp"), tiny_data, progress=False).metrics
    accum = runner.train(_plan(tiny_params, "amp_accum"), tiny_data, progress=False).metrics
    assert amp["activation_bytes"] < 0.75 * fp32["activation_bytes"]
    assert accum["activation_bytes"] < 0.4 * amp["activation_bytes"]  # a quarter of the batch per forward


def test_overflowing_step_is_skipped_and_counted(tiny_params, tiny_data, monkeypatch):
    """An inf gradient: the step is skipped (weights unchanged), counted, and the scale backs off."""
    overflow_at(monkeypatch, 1)
    result = runner.train(_plan(tiny_params, "amp"), tiny_data, progress=False)
    m = result.metrics
    assert m["skipped_steps"] == 1 and m["final_loss_scale"] == 4096
    assert result.scale_history[1] == {"step": 1, "scale": 4096.0, "skipped": True}


def test_lr_schedule_warms_up_then_decays():
    f = schedule.lr_lambda(100)
    assert f(0) == pytest.approx(0.2) and f(4) == pytest.approx(1.0)
    assert f(50) < 1 and f(99) < 0.01


def test_the_host_mirror_follows_the_grad_scaler_through_skips_and_growth():
    """HostScale, fed only whether each step was taken, holds exactly the GradScaler's scale: backoff on a
    skip, growth after growth_interval steps taken (odd factors included: float32 arithmetic)."""
    lin = nn.Linear(4, 1)
    opt = torch.optim.SGD(lin.parameters(), lr=0.01)
    for factors in ({"growth_factor": 2.0, "backoff_factor": 0.5}, {"growth_factor": 1.7, "backoff_factor": 0.3}):
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=3, **factors)
        taken, mirror = ledger.TakenSteps(opt), ledger.HostScale(scaler)
        for i, poison in enumerate([0, 0, 0, 1, 0, 1, 1, 0, 0, 0, 0, 0, 0, 1, 0]):
            opt.zero_grad()
            scaler.scale(lin(torch.randn(8, 4)).pow(2).mean()).backward()
            if poison:
                lin.weight.grad[0, 0] = float("inf")
            before = taken.count
            scaler.step(opt)
            scaler.update()
            skipped = taken.count == before
            assert skipped == bool(poison), i
            assert mirror.update(skipped) == scaler.get_scale(), i


def test_an_fp16_step_syncs_the_host_once(tiny_params, tiny_data, monkeypatch):
    """The trainer detects a skipped step without reading the scale (an .item()) each step: GradScaler's own
    inf check is the one sync; the scale is read once an epoch, to check the host's mirror."""
    reads = []
    real = torch.amp.GradScaler.get_scale
    monkeypatch.setattr(torch.amp.GradScaler, "get_scale", lambda self: reads.append(1) or real(self))
    overflow_at(monkeypatch, 2)  # the second step overflows: it must still be seen as skipped
    tiny_params["train"]["epochs"] = 2
    trainer = engine.Trainer(_plan(tiny_params, "amp", epochs=2), tiny_data, progress=False)
    reads.clear()
    steps = 0
    for _ in range(2):
        trainer.run_epoch()
        steps += trainer.steps_per_epoch
    assert steps == 4 and len(reads) == 2  # one check per epoch, none per step
    assert trainer.ledger.skipped == 1 and trainer.ledger.last_scale == 4096
    assert trainer.ledger.scale_history[1] == {"step": 2, "scale": 4096.0, "skipped": True}


def test_the_last_partial_batch_is_not_trained_so_every_timed_step_has_one_shape(tiny_params, tmp_path):
    """70 images at batch 32: two full batches an epoch; a third of 6 images would be a new shape after the
    warm-up (cuDNN autotuning, or a recompile with train.compile, inside a timed step)."""
    out = tmp_path / "prepared"
    data.prepare(config.DataConfig(source="synthetic", train_size=70, test_size=32), 0, out, out / "raw")
    result = runner.train(_plan(tiny_params, "fp32", epochs=2, warmup_steps=1), data.load_prepared(out, "cpu"),
                          progress=False)
    m = result.metrics
    assert m["optimizer_steps"] == 4 and m["train_images_per_epoch"] == 64 and m["train_images"] == 70
    assert m["timed_steps"] == 3 and m["imgs_per_s"] == pytest.approx(3 * 32 / (sum(result.step_times_ms) / 1000))


def test_the_training_peak_is_the_steady_state_one_with_autotuning_and_evaluation_apart(tiny_params, tiny_data,
                                                                                          monkeypatch):
    """A fake CUDA allocator: the first step allocates a 500-byte cuDNN workspace, every step 100, evaluation
    800. The training peak is the steady state's (100), the first step and evaluation have their own, and no
    counter is reset by emptying the cache (a sync) mid-training."""
    allocated = {"peak": 0}
    calls = []

    def use(nbytes):
        allocated["peak"] = max(allocated["peak"], nbytes)

    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda *a: calls.append("reset")
                        or allocated.update(peak=0))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a: allocated["peak"])
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda *a: allocated["peak"] * 2)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    real_step, real_eval = step.train_step, engine.evaluate
    steps = {"n": 0}

    def train_step(*args, **kw):
        steps["n"] += 1
        use(500 if steps["n"] == 1 else 100)
        return real_step(*args, **kw)

    def evaluate(*args, **kw):
        use(800)
        return real_eval(*args, **kw)

    monkeypatch.setattr(step, "train_step", train_step)
    monkeypatch.setattr(engine, "evaluate", evaluate)
    trainer = engine.Trainer(_plan(tiny_params, "fp32", epochs=2), tiny_data, progress=False)
    trainer.peaks.cuda = True  # the CPU trainer with the CUDA meter
    calls.clear()
    for _ in range(2):
        trainer.run_epoch()
    assert "empty_cache" not in calls
    assert trainer.peaks.peaks == {"first step": {"peak_mem_bytes": 500, "peak_reserved_bytes": 1000},
                                   "train": {"peak_mem_bytes": 100, "peak_reserved_bytes": 200},
                                   "eval": {"peak_mem_bytes": 800, "peak_reserved_bytes": 1600}}


def test_an_epoch_whose_every_loss_was_inf_stops_instead_of_reporting_a_loss_of_zero(tiny_params, tiny_data,
                                                                                    monkeypatch, tmp_path):
    """Every step of an epoch skipped with an inf loss, fewer than amp.max_consecutive_nonfinite of them: the
    epoch's mean loss is NaN (no image counted), not 0.0, and the stop on an inf/NaN training loss fires."""
    real = step.accumulate_gradients

    def inf_loss(model, *args):
        loss = real(model, *args)
        next(model.parameters()).grad[0].fill_(float("inf"))  # the scaler skips the step
        return loss * float("inf")
    monkeypatch.setattr(step, "accumulate_gradients", inf_loss)
    data.prepare(config.DataConfig(source="synthetic", train_size=320, test_size=32), 0, tmp_path, tmp_path / "raw")
    long_data = data.load_prepared(tmp_path, "cpu")  # 40 steps of 8 images an epoch
    tiny_params["amp"]["max_consecutive_nonfinite"] = 100  # more than an epoch's steps: the mean must say it
    with pytest.raises(NonFiniteTraining, match="the training loss became inf/NaN"):
        runner.train(_plan(tiny_params, "amp"), tiny_data, progress=False)
    # within an epoch, under fp16, amp.max_consecutive_nonfinite decides (here 30 of 40 steps, past the loop's
    # 25-step check), not a window whose every loss was inf
    tiny_params["amp"]["max_consecutive_nonfinite"] = 30
    with pytest.raises(NonFiniteTraining, match="30 steps in a row had an inf/NaN loss"):
        runner.train(_plan(tiny_params, "amp", batch_size=8, warmup_steps=1), long_data, progress=False)


def test_a_trainer_is_freed_when_its_last_reference_goes(tiny_params, tiny_data):
    """No reference cycle through the trainer (its ledger holds its stop weakly): a streamed run's DataLoader
    workers go with it, not at some later garbage collection that then waits seconds on them (20 s in a stage's
    MLflow import)."""
    import gc
    import weakref
    trainer = engine.Trainer(_plan(tiny_params, "amp"), tiny_data, progress=False)
    trainer.run_epoch()
    ref = weakref.ref(trainer)
    gc.disable()
    try:
        del trainer
        assert ref() is None
    finally:
        gc.enable()


SCHEDULE_ON_DEVICE = {"aten.eq": 1, "aten.add_": 1, "aten.clamp": 1, "aten.index_select": 1}  # DeviceSchedule.step


@pytest.mark.parametrize("variant,impl,more", [("fp32", "foreach", {}), ("amp", "fused", SCHEDULE_ON_DEVICE)])
def test_the_engines_step_dispatches_the_recipes_ops_and_one_detach(tiny_params, tiny_data, variant, impl, more):
    """A step of the engine, counted op by op against the AMP recipe's step: fp32's is the recipe's and the loss's
    one detach; fp16 with a fused optimizer (whose skips only the device knows) adds the schedule's four device
    ops, and no more detaches: every op the host dispatches is step time on a launch-bound GPU."""
    from collections import Counter

    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen[str(func.overloadpacket)] += 1
            return func(*args, **(kwargs or {}))

    tiny_params["variants"][variant]["optimizer_impl"] = impl
    trainer = engine.Trainer(runplan.make_plan(config.from_dict(tiny_params), variant, "cpu"), tiny_data,
                             progress=False)
    x, y = next(trainer.train_batches.epoch(0))
    trainer.optimizer_step(x, y)  # the optimizer's state made
    with Ops() as eng:
        trainer.optimizer_step(x, y)
    with Ops() as recipe:  # the recipe's step on the same model, optimizer and scaler
        trainer.opt.zero_grad(set_to_none=True)
        with trainer.policy.autocast():
            loss = torch.nn.functional.cross_entropy(trainer.model(x), y)
        trainer.scaler.scale(loss).backward()
        trainer.scaler.step(trainer.opt)
        trainer.scaler.update()
    assert eng.seen - recipe.seen == Counter({"aten.detach": 1, **more}) and not recipe.seen - eng.seen
