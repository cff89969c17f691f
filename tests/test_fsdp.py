"""FSDP2 on 2 gloo ranks (test_distributed's helpers), against DDP and one process on the same global batch: one
step's gradients and three steps' weights, accumulation with the gradient sync off but for the last micro-batch,
the clipped norm (the global one), an inf in one rank's shard (every rank skips), the bf16 and fp16 policies within
their rounding, fp8's weights gathered in fp8, the blocks sharded, and the bytes on the wire counted against the
collectives' own. A whole run under FSDP, and its checkpoint: test_fsdp_runs.py."""

from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from ampbench.data.batches import DeviceBatches
from ampbench.train import fsdp, step
from ampbench.train.policy import PrecisionPolicy
from tests.test_distributed import MEAN, STD, WORLD, _images, _join, _model, _spawn

BATCH = 16  # global: 8 images a rank


def _rel(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    """The relative difference of two sets of gradients (or weights) as one vector: ||a - b|| / ||b||."""
    return float(torch.cat([(x - y).flatten() for x, y in zip(a, b, strict=True)]).norm()
                 / torch.cat([y.flatten() for y in b]).norm())


def _grads(model) -> list[torch.Tensor]:
    return [fsdp.full(p.grad).detach().clone() for p in model.parameters()]


def _weights(model) -> list[torch.Tensor]:
    return [fsdp.full(p.detach()).clone() for p in model.parameters()]


@contextmanager
def _counting():
    """What FSDP's collectives send, by kind: [dtypes, bytes of their inputs, calls]."""
    import torch.distributed as dist
    sent, real = {}, {"all_gather": dist.all_gather_single, "reduce_scatter": dist.reduce_scatter_single}

    def counting(kind):
        def call(*a, **kw):
            t = kw["input"] if "input" in kw else a[1]
            dtypes, size, calls = sent.setdefault(kind, [[], 0, 0])
            sent[kind] = [sorted({*dtypes, str(t.dtype).removeprefix("torch.")}), size + t.numel() * t.element_size(),
                          calls + 1]
            return real[kind](*a, **kw)
        return call
    dist.all_gather_single, dist.reduce_scatter_single = counting("all_gather"), counting("reduce_scatter")
    try:
        yield sent
    finally:
        dist.all_gather_single, dist.reduce_scatter_single = real.values()


def _sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def _worker(rank: int, port: int, folder: str) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP
    world = _join(rank, port)
    images, labels = _images(3 * BATCH)
    mine = DeviceBatches(images, labels, BATCH, MEAN, STD, augment=False, shuffle=False, channels_last=False,
                         shard=(rank, WORLD))
    whole = DeviceBatches(images, labels, BATCH, MEAN, STD, augment=False, shuffle=False, channels_last=False)
    parts, batches = list(mine.epoch(0)), list(whole.epoch(0))
    (x, y), (gx, gy) = parts[0], batches[0]
    out = {}
    one = _model()
    F.cross_entropy(one(gx), gy).backward()
    ddp_model = _model()
    ddp = DDP(ddp_model)
    F.cross_entropy(ddp(x), y).backward()
    sharded = fsdp.shard(_model(), world, "cpu", "fp32")
    with _counting() as sent:
        F.cross_entropy(sharded(x), y).backward()
    out["sent"] = sent
    out["counted"] = fsdp.wire_bytes(sharded, WORLD, "fp32")
    out["parts"] = fsdp.memory_parts(sharded, WORLD, "fp32")
    out["held"] = [sum(t.to_local().numel() * t.element_size() for t in ts) for ts in
                   ([p.detach() for p in sharded.parameters()], [p.grad for p in sharded.parameters()])]
    out["grad_vs_one"] = _rel(_grads(sharded), _grads(one))
    out["grad_vs_ddp"] = _rel(_grads(sharded), _grads(ddp_model))
    out["sharded_grads"] = all(type(p.grad).__name__ == "DTensor" for p in sharded.parameters())
    # the clipped norm: the global one, as DDP's (each rank holds a shard of every gradient)
    out["norm"] = float(fsdp.full(torch.nn.utils.clip_grad_norm_(list(sharded.parameters()), 1e-3)))
    out["ddp_norm"] = float(torch.nn.utils.clip_grad_norm_(list(ddp_model.parameters()), 1e-3))
    # a frozen weight (fine-tuning) in a block whose other parameters train: no gradient, the others as one process's
    frozen = [_model(), _model()]
    for model in frozen:
        model[0][0].weight.requires_grad_(False)
    fsdp.shard(frozen[1], world, "cpu", "fp32")
    F.cross_entropy(frozen[0](gx), gy).backward()
    F.cross_entropy(frozen[1](x), y).backward()
    out["frozen_vs_one"] = _rel(*[[fsdp.full(q.grad) for q in m.parameters() if q.requires_grad] for m in frozen[::-1]])
    out["frozen_no_grad"] = frozen[1][0][0].weight.grad is None
    # three steps, each rank on its slice of each batch, against one process on the whole batches
    one, sharded = _model(), fsdp.shard(_model(), world, "cpu", "fp32")
    for model, data in ((one, batches), (sharded, parts)):
        opt = _sgd(model)
        for bx, by in data:
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(model(bx), by).backward()
            opt.step()
    out["weights_vs_one"] = _rel(_weights(sharded), _weights(one))
    # accumulation: 2 micro-batches a rank, the reduce-scatter once, after the last
    one, sharded = _model(), fsdp.shard(_model(), world, "cpu", "fp32")
    F.cross_entropy(one(gx), gy).backward()
    policy = PrecisionPolicy("fp32", "cpu", None)
    step.accumulate_gradients(sharded, x, y, len(y) // 2, policy, policy.scaler())
    out["accum_vs_one"] = _rel(_grads(sharded), _grads(one))
    # the policies: bf16 and fp16 copies gathered, fp32 gradients reduced; against DDP under the same autocast
    for name, reduce in (("bf16", "fp32"), ("fp16", "fp32"), ("bf16", "bf16")):
        ddp_model, sharded = _model(), fsdp.shard(_model(), world, "cpu", name, reduce)
        for model in (DDP(ddp_model), sharded):
            with torch.autocast("cpu", dtype=fsdp.param_dtype(name)), _counting() as sent:
                F.cross_entropy(model(x), y).backward()
        out[f"{name}_{reduce}_sent"] = sent
        out[f"{name}_{reduce}_counted"] = fsdp.wire_bytes(sharded, WORLD, name, reduce)
        if reduce == "bf16":
            out["bf16_bf16_vs_ddp"] = _rel(_grads(sharded), _grads(ddp_model))
            continue
        out[f"{name}_vs_ddp"] = _rel(_grads(sharded), _grads(ddp_model))
        out[f"{name}_vs_one"] = _rel(_grads(sharded), _grads(one))
        out[f"{name}_grad_dtype"] = str(next(sharded.parameters()).grad.dtype)
    # fp8 (tensorwise): the converted weights gathered in fp8 with the whole weight's scale, against DDP's Float8Linear
    # casting the same fp32 weights, under the rung's bf16 autocast; three steps, the scales refreshed after each
    out.update(_fp8(world, x, y))
    # an inf in rank 1's shard alone, under the rung's GradScaler
    sharded = fsdp.shard(_model(), world, "cpu", "fp32")
    opt, scaler = _sgd(sharded), torch.amp.GradScaler("cpu", init_scale=1024.0)
    scaler.scale(F.cross_entropy(sharded(x), y)).backward()
    poisoned = next(p for p in sharded.parameters() if p.grad.to_local().numel()).grad.to_local().view(-1)
    if rank == 1:
        poisoned[0] = float("inf")
    out["finite_here"] = bool(poisoned.isfinite().all())
    before = _weights(sharded)
    scaler.step(opt)
    scaler.update()
    out["stepped"] = any(not torch.equal(a, b) for a, b in zip(before, _weights(sharded), strict=True))
    out["scale"] = float(scaler.get_scale())
    (Path(folder) / f"rank{rank}.json").write_text(json.dumps(out))
    torch.distributed.destroy_process_group()


def _mlp():
    torch.manual_seed(0)
    return mlp(image_size=16)


def _fp8(world, x, y) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from ampbench.precision import float8
    out, grads, weights = {}, [], []
    for sharded in (False, True):
        model = float8.convert(_mlp(), "tensorwise", sharded=sharded)
        if sharded:
            fsdp.shard(model, world, "cpu", "fp8")
        opt = _sgd(model)
        fsdp.after_each_step(model, opt, "fp8" if sharded else "fp32")
        stepped = model if sharded else DDP(model)
        for i in range(3):
            opt.zero_grad(set_to_none=True)
            with float8._mkldnn_off(), torch.autocast("cpu", dtype=torch.bfloat16), _counting() as sent:
                F.cross_entropy(stepped(x), y).backward()
            if i == 0:
                grads.append(_grads(model))
                if sharded:
                    out["fp8_sent"], out["fp8_counted"] = sent, fsdp.wire_bytes(model, WORLD, "fp8")
                    out["fp8_parts"] = fsdp.memory_parts(model, WORLD, "fp8")
            opt.step()
        weights.append(_weights(model))
    out["fp8_converted"] = sum(type(m).__name__ == "Float8Linear" for m in model.modules())
    out["fp8_vs_ddp"], out["fp8_weights_vs_ddp"] = _rel(grads[1], grads[0]), _rel(weights[1], weights[0])
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    folder = tmp_path_factory.mktemp("fsdp")
    _spawn(_worker, str(folder))
    return [json.loads((folder / f"rank{r}.json").read_text()) for r in range(WORLD)]


def test_fsdp_gradients_and_weights_equal_ddp_s_and_one_process_s(ranks):
    """fp32: only the order of the sums differs (a reduce-scatter of two halves against one batch's sum), so the
    gradients agree to a few float32 roundings of the largest (2^-24 each); after three SGD steps the weights
    too, and with a frozen weight beside trained ones in a block. A gloo path that summed the ranks' gradients
    instead of averaging them (pytorch/pytorch#162338) would be off by 2x: a relative difference of 1.0."""
    eps = torch.finfo(torch.float32).eps
    for r in ranks:
        assert r["sharded_grads"]
        assert r["grad_vs_one"] < 64 * eps and r["grad_vs_ddp"] < 64 * eps, r
        assert r["accum_vs_one"] < 64 * eps and r["frozen_vs_one"] < 64 * eps, r
        assert r["frozen_no_grad"]
        assert r["weights_vs_one"] < 1e3 * eps, r
        assert r["norm"] == pytest.approx(r["ddp_norm"], rel=64 * eps)
    assert ranks[0]["norm"] == ranks[1]["norm"]  # one global norm, not each rank's shard's


def test_the_bf16_and_fp16_policies_gather_in_their_dtype_and_reduce_fp32_gradients(ranks):
    """Each rank's forward and backward under FSDP's bf16 (fp16) copies is DDP's under autocast, which casts the
    same weights to the same dtype: the gradients agree as fp32's do. The collectives send what the policy says:
    the gathered copies in the low dtype (BatchNorm's in fp32), the gradients in the reduce dtype, bf16's reduce
    half fp32's bytes and one bf16 rounding off it. The sharded gradients stay fp32."""
    eps = torch.finfo(torch.float32).eps
    for r in ranks:
        assert r["bf16_grad_dtype"] == r["fp16_grad_dtype"] == "torch.float32"
        assert r["bf16_vs_ddp"] < 64 * eps and r["fp16_vs_ddp"] < 64 * eps, r  # the same arithmetic as DDP's
        assert r["bf16_bf16_vs_ddp"] < 2 ** -8, r  # bf16's reduce: the sum rounded to 8 significant bits
        for name in ("bf16_fp32", "fp16_fp32", "bf16_bf16"):  # BatchNorm's shards gathered as fp32
            low, reduce = name.split("_")
            assert r[f"{name}_sent"]["all_gather"][0] == sorted([{"bf16": "bfloat16", "fp16": "float16"}[low],
                                                                 "float32"])
            assert r[f"{name}_sent"]["reduce_scatter"][0] == [{"fp32": "float32", "bf16": "bfloat16"}[reduce]]
        assert r["bf16_bf16_sent"]["reduce_scatter"][1] * 2 == r["bf16_fp32_sent"]["reduce_scatter"][1]
        for name in ("bf16_fp32", "fp16_fp32", "bf16_bf16"):  # the blocks' low dtype and BatchNorm's fp32, counted
            counted = r[f"{name}_counted"]
            assert counted["all_gather"]["bytes"] == pytest.approx(
                (WORLD - 1) * r[f"{name}_sent"]["all_gather"][1], rel=2e-2)  # (shards padded to equal sizes)
            assert sorted(counted["all_gather"]["by_dtype"]) == r[f"{name}_sent"]["all_gather"][0]
            assert counted["reduce_scatter"]["bytes"] == (WORLD - 1) * r[f"{name}_sent"]["reduce_scatter"][1] // WORLD
        assert r["fp16_vs_one"] < r["bf16_vs_one"]


def test_fp8_gathers_its_weights_in_fp8_and_trains_as_under_ddp(ranks):
    """torchao's float8 all-gather: each rank casts its shard of a converted weight with the scale of the whole
    weight (the amax all-reduced after each step) and gathers fp8, which is what DDP's Float8Linear casts from the
    same fp32 weights; the rest of a block gathers in bf16, as autocast casts it. So the gradients and three
    steps' weights agree as fp32's do (the sums' order), and the bytes sent are the ones counted."""
    eps = torch.finfo(torch.float32).eps
    for r in ranks:
        assert r["fp8_converted"] == 2  # the two 64x64 blocks' layers (not the first layer, not the head)
        assert r["fp8_vs_ddp"] < 64 * eps and r["fp8_weights_vs_ddp"] < 1e3 * eps, r
        sent, counted = r["fp8_sent"], r["fp8_counted"]
        assert "float8_e4m3fn" in sent["all_gather"][0] or "uint8" in sent["all_gather"][0], sent
        assert counted["all_gather"]["by_dtype"]["float8_e4m3fn"] == 2 * 2 * 64 * 64 // 2  # 2 gathers, 2 weights
        assert counted["all_gather"]["bytes"] == pytest.approx((WORLD - 1) * sent["all_gather"][1], rel=2e-2)
        assert sent["reduce_scatter"][0] == ["float32"]


def test_an_inf_in_one_rank_s_shard_skips_the_step_on_every_rank(ranks):
    """Only rank 1 holds the poisoned gradient (rank 0's shard is finite): the GradScaler's inf check over the
    DTensor shards reduces its found-inf, so both ranks skip the step and halve the scale."""
    assert [r["finite_here"] for r in ranks] == [True, False]
    assert [r["stepped"] for r in ranks] == [False, False]
    assert [r["scale"] for r in ranks] == [512.0, 512.0]


def test_the_bytes_counted_are_the_bytes_the_collectives_send(ranks):
    """fp32 without a policy: one all-gather of every block's and the root's parameters for the forward, one again
    for the backward (resharded after the forward), one reduce-scatter of the gradients; the counted (N-1)/N share
    of each collective's input is what a ring sends."""
    sent, counted = ranks[0]["sent"], ranks[0]["counted"]
    params = sum(p.numel() for p in _model().parameters())
    assert sent["reduce_scatter"][0] == ["float32"] and sent["reduce_scatter"][1] == params * 4
    assert counted["reduce_scatter"]["bytes"] == params * 4 // 2
    # an all-gather's input is this rank's shard, 1/N of the whole (padded to equal shards): a ring sends N-1 of them
    assert sent["all_gather"][0] == ["float32"] and sent["all_gather"][2] == 2 * len(fsdp.blocks(_model()))
    assert counted["all_gather"]["bytes"] == pytest.approx((WORLD - 1) * sent["all_gather"][1], rel=1e-3)
    assert counted["all_gather"]["bytes"] == 2 * params * 4 // 2
    # and each rank holds its shard alone: the parameters' and the gradients' counted bytes are what it holds
    for r in ranks:
        assert r["held"][0] == pytest.approx(r["parts"]["parameters"], rel=1e-3)
        assert r["held"][1] == pytest.approx(r["parts"]["gradients"], rel=1e-3)


def mlp(num_classes: int = 10, image_size: int = 32) -> torch.nn.Module:
    """The fp8 runs' model (``model.factory``): two 64-wide blocks fp8 converts between a first layer and a head."""
    block = lambda: torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU())  # noqa: E731
    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * image_size ** 2, 64), block(), block(),
                               torch.nn.Linear(64, num_classes))
