"""One precision's sweep point, as training runs it: the trainer's builder (``train.setup.build``), the engine's
own step on a batch drawn from the prepared set, timed on the trainer's clock."""

from __future__ import annotations

import gc

import torch

from ampbench import models, runplan
from ampbench.config import Config
from ampbench.data.batches import DeviceBatches
from ampbench.errors import analysis
from ampbench.measure import clock, flops, memory, stats
from ampbench.train import probes, setup, step

POOL = 2048  # images decoded once from a streamed folder, from which every point draws its batch
WARMUP = 2  # untimed steps before each point's timed ones (allocation, cuDNN autotuning)


class Bench:
    """One precision's setup on one device (the trainer's builder: ``train.setup.build``), and its batches."""

    def __init__(self, cfg: Config, data: dict, device: torch.device, precision: str,
                 plan: runplan.RunPlan | None = None):
        """``plan``: a variant's own (the paired check); by default the sweep's plan of ``precision``."""
        self.cfg, self.data, self.device, self.precision = cfg, data, device, precision
        self.plan = plan or runplan.for_precision(cfg, precision, device.type)
        s = setup.build(self.plan, data["meta"], device)
        self.input_size = s.input_size
        self.model = s.model
        self.step_model = s.step_model
        self.opt = s.opt
        self.policy = s.policy
        self.scaler = s.scaler
        x, y = self.data["train"]
        if not isinstance(x, torch.Tensor):  # a streamed folder's files: a pool decoded once, the points drawn from it
            keep = torch.randperm(len(y), generator=torch.Generator().manual_seed(cfg.seed))[:POOL].sort().values
            x, y = x[keep], y[keep]
        self.pool = x, y
        x, y = next(self.batches(8).epoch(0))
        plain = setup.plain_model(s, data["meta"], device)
        # per image: the same at any batch; None (no TFLOP/s) when the counter cannot follow the model
        self.flops_per_image = analysis("flops", models.name(cfg.model), flops.train_flops_per_image, plain, x, y)[0]
        # the images every batch tried is a multiple of: a converting rung's micro-batch rule on this device
        found = self.policy.census(plain, s.input_size) if self.policy.rung.converts else None
        self.multiple = self.policy.rung.images_multiple(found, device.type) if found else 1

    def batches(self, batch: int) -> DeviceBatches:
        """``batch`` images drawn from the training set (with replacement when it holds fewer)."""
        x, y = self.pool  # wherever the set is (the sweep stage leaves it memory-mapped on the host)
        g = torch.Generator(device=x.device).manual_seed(self.cfg.seed + batch)
        idx = torch.randint(0, len(y), (batch,), device=x.device, generator=g)
        meta = self.data["meta"]
        x, y = x[idx].to(self.device), y[idx].to(self.device)  # only the images a point trains on go to the device
        return DeviceBatches(x, y, batch, meta["mean"], meta["std"], augment=self.cfg.train.augment,
                             shuffle=True, channels_last=self.cfg.model.channels_last, seed=self.cfg.seed,
                             out_size=self.input_size)

    def run(self, batch: int, steps: int, feed: DeviceBatches | None = None, warmup: int = WARMUP,
            after_warmup=None) -> clock.StepClock:
        """``warmup`` untimed then ``steps`` timed optimizer steps at ``batch``, on the trainer's clock;
        ``after_warmup()`` called between them."""
        feed = feed or self.batches(batch)
        timer = clock.StepClock(self.device, warmup)
        timer.begin()
        for i in range(warmup + steps):
            if i == warmup and after_warmup is not None:
                after_warmup()
            with timer.data():
                x, y = next(feed.epoch(i))
            with timer.compute():
                step.train_step(self.step_model, self.opt, self.scaler, self.policy, x, y, batch,
                                clip=self.cfg.train.clip_grad_norm)
            timer.step_done(len(y))
        timer.end()
        return timer

    def compile_afresh(self) -> None:
        """A compiled step model compiles again, for the batch it meets next: without this dynamo would compile
        the first batch static, mark the batch dynamic at the second, and run every later batch through one
        symbolic graph, which is not what a training run at that batch runs (a reset, not ``dynamic=False``: that
        would hit the recompile limit over a largest-batch search and fall back to eager without a word)."""
        if self.plan.train.compile:
            torch._dynamo.reset()

    def try_step(self, batch: int) -> None:
        """One optimizer step at ``batch``, waited for, so that an error of its kernels surfaces here."""
        self.compile_afresh()
        x, y = next(self.batches(batch).epoch(0))
        step.train_step(self.step_model, self.opt, self.scaler, self.policy, x, y, batch,
                        clip=self.cfg.train.clip_grad_norm)
        clock.synchronize(self.device)

    def free(self) -> None:
        """Drop gradients and cached blocks, e.g. after an out-of-memory attempt."""
        self.opt.zero_grad(set_to_none=True)
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def point(self, batch: int, steps: int) -> dict:
        """The timed steps at ``batch``: their rate and, on CUDA, their peak memory (the counters reset after the
        warm-up steps, as training's are: cuDNN's autotuning and a compilation are not the steady state); then the
        activation probe, with the gradients freed first. A probe that fails is the probe's (no bytes, said): the
        point's steps ran."""
        self.compile_afresh()
        memory.reset_peak_memory(self.device)
        feed = self.batches(batch)
        peaks = memory.PeakWindows(self.device)
        timed = self.run(batch, steps, feed, after_warmup=lambda: peaks.open("train"))
        peaks.close()
        ips = timed.imgs_per_s()
        out = {"precision": self.precision, "batch_size": batch, "imgs_per_s": ips,
               "imgs_per_s_p10_p90": stats.rate_spread(timed.step_rates()),
               "step_time_ms": stats.summarize_ms(timed.cycle_ms),
               **memory.peak_memory(self.device), **peaks.peaks.get("train", {}),
               "achieved_tflops": self.flops_per_image * ips / 1e12 if ips and self.flops_per_image else None}
        self.free()
        x, _ = next(feed.epoch(0))
        out["activation_bytes"], _ = analysis("activations", f"{models.name(self.cfg.model)} ({self.precision}, batch "
                                              f"{batch})", probes.activation_bytes, self.model, x, self.policy)
        if self.plan.train.compile:  # the probe runs the eager model: a compiled step saves what Inductor keeps
            out["activation_meter"] = "eager"
        self.free()
        return out

    def fixed_bytes(self) -> int:
        params = list(self.model.parameters())  # the weights, and a gradient for each trained one
        return memory.tensor_bytes(params) + memory.tensor_bytes(p for p in params if p.requires_grad) \
            + memory.optimizer_state_bytes(self.opt)
