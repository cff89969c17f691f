"""GPU validation: what no CPU test can check, on a real GPU, in a few minutes; each check printed with its figure.

    PYTHONPATH=src python3 benchmarks/gpu_validate.py --out benchmarks/results/gpu_validate   # make gpu-validate
    python benchmarks/gpu_validate.py --dry-run                                              # the checks, listed

Needs a CUDA GPU, torch (2.11 or later) with its torchvision, and ampbench's light dependencies (pyyaml, tqdm,
psutil, numpy); no DVC, no MLflow, no package registry. Runs ampbench's engine on ResNet-18 (CIFAR stem) with
CIFAR-shaped synthetic data. Writes ``results.json`` and ``results.md`` under --out as the checks finish, so a run
cut short keeps what it measured; exits 1 if a check failed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
import warnings
from pathlib import Path

try:
    import torch

    from ampbench import config, data, env, runplan, sweep
    from ampbench.data import stream
    from ampbench.measure import memory
    from ampbench.train import engine, runner
except ImportError as err:  # run from the repository root with PYTHONPATH=src, beside torch and torchvision
    sys.exit(f"error: {err}; gpu_validate needs torch, torchvision, pyyaml, tqdm, psutil and numpy, and ampbench "
             "importable: run it from the repository root as PYTHONPATH=src python3 benchmarks/gpu_validate.py")

PRECISIONS = ("fp32", "tf32", "bf16", "fp16")
CHECKS = {
    "host_syncs": "host syncs inside an optimizer step (torch.cuda.set_sync_debug_mode('warn')): none for fp32, "
                  "tf32 and bf16; GradScaler's one for fp16",
    "steady_peak": "the steady-state training peak against activations + parameters + gradients + optimizer state "
                   "+ the data set: at least that, at most 1.5x that + 1 GiB (workspaces, autocast's weight copies)",
    "gpu_busy": "the step profile's GPU busy share is at most 100% (kernels only, overlaps merged)",
    "largest_batch": "the largest-batch search under sweep.memory_limit_gib = 4: measured (not a ceiling or a "
                     "stop), above the first try (256), with the peak reserved at that batch recorded",
    "tf32_getters": "every TF32 getter (old and new API) readable after ampbench sets strict fp32 and TF32",
    "stream": "data.placement: stream on CUDA (pinned memory, non-blocking copies, 4 workers): the batches equal "
              "the same batches streamed to the CPU, and an fp16 epoch's img/s and data-wait share beside the "
              "device-resident set's",
    "nccl_ddp": "two processes over NCCL (2+ GPUs visible): one DDP step leaves the same weights on both",
    "fp8_gemms": "torch._scaled_mm (no torchao) on the three GEMMs of each Linear layer fp8 converts in vit_tiny, at "
                 "15 x the least batch env_check accepts: each runs and matches its fp32 product; one more image "
                 "than a multiple of it: CUDA refuses exactly the weight-gradient GEMMs, as env_check says "
                 "(compute capability 8.9 and later); and a GEMM of each recipe's scaling (tensorwise, rowwise) tried, "
                 "which env_check reads to allow rowwise on compute capability 12.x",
    "launch_floor": "the host's time per kernel launched back to back from eager PyTorch (a one-element add_, "
                    "20,000 of them): the roofline's launch floor on this machine (ampbench roofline --launch-us), "
                    "against its default",
    "host_work": "host work per step, the engine against the AMP recipe's plain loop on the launch-bound small CNN "
                 "at batch 32 (fp32, fp16): the profiler's host us and syncs per step (benchmarks/host_profile.py)",
}


def _plan(precision: str, epochs: int = 1, batch: int = 256, **train) -> runplan.RunPlan:
    cfg = config.from_dict({"device": "cuda", "model": {"arch": "resnet18"}, "mlflow": {"enabled": False},
                            "train": {"epochs": epochs, "batch_size": batch, "warmup_steps": 5, **train},
                            "variants": {precision: {"precision": precision, "accum_steps": 1}},
                            "profile": {"steps": 5}, "amp": {"audit_batches": 0}})
    return runplan.make_plan(cfg, precision, "cuda")


def check_host_syncs(prepared: dict) -> dict:
    per_step, allowed, passed = {}, {}, True
    for precision in PRECISIONS:
        trainer = engine.Trainer(_plan(precision), prepared, progress=False)
        batches = trainer.train_batches.epoch(0)
        for _ in range(3):  # warm: allocations and autotuning sync as they please
            trainer.optimizer_step(*next(batches))
        torch.cuda.synchronize()
        skipped = trainer.ledger.skipped
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")  # a warning per call, not one per call site
            torch.cuda.set_sync_debug_mode("warn")
            try:
                for _ in range(10):
                    trainer.optimizer_step(*next(batches))
            finally:
                torch.cuda.set_sync_debug_mode("default")
        syncs = [w for w in seen if "synchroniz" in str(w.message)]
        # a skipped fp16 step also asks whether its loss was finite (one more sync, on skipped steps only)
        allowed[precision] = (10 + trainer.ledger.skipped - skipped) if trainer.policy.uses_scaler else 0
        per_step[precision] = len(syncs) / 10
        passed = passed and len(syncs) <= allowed[precision]
    return {"figure": per_step, "passed": passed,
            "detail": f"syncs per optimizer step over 10 steps; allowed in all: {allowed}"}


def check_steady_peak(prepared: dict) -> dict:
    figures, passed = {}, True
    for precision in ("fp32", "fp16"):
        m = runner.train(_plan(precision, epochs=2), prepared, progress=False, profile=False).metrics
        predicted = (m["activation_bytes"] + m["param_bytes"] + m["grad_bytes"] + m["optimizer_state_bytes"]
                     + m["dataset_bytes"])
        ok = predicted <= m["peak_mem_bytes"] <= 1.5 * predicted + 2**30
        figures[precision] = {"peak_mem_bytes": m["peak_mem_bytes"], "predicted_bytes": predicted,
                              "ratio": m["peak_mem_bytes"] / predicted, "window": m["peak_window"],
                              "first_step_peak_mem_bytes": m["first_step_peak_mem_bytes"],
                              "eval_peak_mem_bytes": m["eval_peak_mem_bytes"]}
        passed = passed and ok
    return {"figure": figures, "passed": passed, "detail": "steady-state peak / predicted bytes"}


def check_gpu_busy(prepared: dict) -> dict:
    busy = {}
    for precision in ("fp32", "fp16"):
        m = runner.train(_plan(precision), prepared, progress=False).metrics
        busy[precision] = m["profile"]["gpu_busy_fraction"]
    return {"figure": busy, "passed": all(b is not None and 0 < b <= 1.0 for b in busy.values()),
            "detail": "GPU busy share of the profiled steps"}


def check_largest_batch(prepared: dict) -> dict:
    cfg = config.from_dict({"device": "cuda", "model": {"arch": "resnet18"}, "mlflow": {"enabled": False},
                            "sweep": {"memory_limit_gib": 4}})
    device = torch.device("cuda")
    memory.reset_peak_memory(device)  # what earlier checks left cached would count against the cap
    sweep.cap_memory(cfg, device)
    try:
        bench = sweep.Bench(cfg, prepared, device, "fp16")
        limit, what = sweep.limit_bytes(cfg, device)
        found = sweep.search_max(bench, 256, limit, what)
        peak = None
        if found["largest_batch"]:  # its step again, its peak measured: within the cap by construction
            memory.reset_peak_memory(device)
            bench.try_step(found["largest_batch"])
            peak = torch.cuda.max_memory_reserved()
            bench.free()
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, torch.cuda.current_device())
    return {"figure": {"largest_batch": found["largest_batch"], "method": found["method"], "tries": found["tries"],
                       "peak_reserved_bytes": peak, "limit_bytes": limit, "notes": found["notes"]},
            "passed": found["method"] == "measured" and bool(found["largest_batch"]) and found["largest_batch"] > 256,
            "detail": found["how"]}


def check_tf32_getters(prepared: dict) -> dict:
    from ampbench import precision
    read = {}
    for allow in (False, True, False):
        precision.set_tf32(allow)
        try:
            read[str(allow)] = [torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32,
                                torch.get_float32_matmul_precision(), torch.backends.cuda.matmul.fp32_precision,
                                torch.backends.cudnn.conv.fp32_precision]
        except RuntimeError as err:
            return {"figure": read, "passed": False, "detail": str(err)[:300]}
    return {"figure": read, "passed": True, "detail": "getters after set_tf32(False, True, False)"}


def check_stream(prepared: dict) -> dict:
    host = {k: tuple(t.cpu() for t in v) if k != "meta" else v for k, v in prepared.items()}
    meta = host["meta"]

    def feed(device: str, workers: int):
        return stream.StreamBatches(*host["train"], 256, meta["mean"], meta["std"], augment=True, shuffle=True,
                                    channels_last=True, device=device, workers=workers, seed=0)
    cuda, cpu = feed("cuda", 4), feed("cpu", 0)
    cuda.sampler.keys = cuda.keys(0)[:1]
    pinned = next(iter(cuda.loader))[0].is_pinned()  # what the loader hands over, before the copy
    worst = 0.0
    for i, ((xg, yg), (xc, yc)) in enumerate(zip(cuda.epoch(0), cpu.epoch(0), strict=True)):
        worst = max(worst, (xg.cpu() - xc).abs().max().item())
        assert xg.is_cuda and torch.equal(yg.cpu(), yc), f"batch {i}: labels differ"
        if i == 3:
            break
    rates = {}
    for placement in ("device", "stream"):
        plan = dataclasses.replace(_plan("fp16"), placement=placement, workers=4 if placement == "stream" else 0)
        m = runner.train(plan, host if placement == "stream" else prepared, progress=False, profile=False).metrics
        rates[placement] = {"imgs_per_s": m["imgs_per_s"], "data_time_fraction": m["data_time_fraction"]}
    return {"figure": {"pinned": pinned, "max_abs_diff_vs_cpu": worst, **rates},
            "passed": pinned and worst < 1e-4 and rates["stream"]["imgs_per_s"] > 0,
            "detail": "streamed batches on CUDA against the CPU's; fp16 img/s and data wait, device vs stream"}


def _ddp_worker(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=2, device_id=torch.device("cuda", rank))
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(64, 8).cuda(rank), device_ids=[rank])
    x = torch.randn(16, 64, device=f"cuda:{rank}") * (rank + 1)  # different data on each rank
    model(x).square().mean().backward()
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    weights = [p.detach().clone() for p in model.parameters()]
    gathered = [[torch.empty_like(w) for w in weights] for _ in range(2)]
    for i, w in enumerate(weights):
        dist.all_gather([g[i] for g in gathered], w)
    if rank == 0:
        Path(out).write_text(json.dumps(all(torch.equal(a, b) for a, b in zip(*gathered, strict=True))))
    dist.destroy_process_group()


def check_nccl_ddp(prepared: dict) -> dict:
    if torch.cuda.device_count() < 2:
        return {"figure": torch.cuda.device_count(), "passed": None, "detail": "skipped: one GPU visible"}
    import socket
    import tempfile

    import torch.multiprocessing as mp
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "same.json"
        mp.spawn(_ddp_worker, args=(port, str(out)), nprocs=2, join=True)
        same = json.loads(out.read_text())
    return {"figure": same, "passed": same, "detail": "weights equal on both ranks after one DDP step"}


def _fp8_gemm(a_shape: tuple, b_shape: tuple) -> float:
    """One tensorwise-scaled fp8 GEMM as torchao runs it (row-major e4m3 by column-major e4m3, bf16 out): its
    relative error against the fp32 product of the same fp8 values."""
    a = torch.randn(a_shape, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(b_shape[::-1], device="cuda").to(torch.float8_e4m3fn).t()  # column-major, as torch wants
    one = torch.ones((), device="cuda")
    out = torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16).float()
    return _rel_err(out, a.float() @ b.float())


def _recipe_gemm(recipe: str) -> bool | str:
    """Whether this card runs the fp8 GEMM of ``recipe``'s scaling (tensorwise: one scale per tensor; rowwise: one
    per row of A and column of B, as torchao's rowwise recipes call it) within fp8's error: True, or the error."""
    m, k, n = 256, 512, 384
    a = torch.randn(m, k, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(n, k, device="cuda").to(torch.float8_e4m3fn).t()
    if recipe == "tensorwise":
        sa = sb = torch.ones((), device="cuda")
    else:
        sa, sb = torch.ones(m, 1, device="cuda"), torch.ones(1, n, device="cuda")
    try:
        out = torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16).float()
    except RuntimeError as err:
        return str(err).strip().splitlines()[0][:200]
    err = _rel_err(out, a.float() @ b.float())
    return True if err < 2e-2 else f"relative error {err:.3g}"


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out - ref).norm() / ref.norm())


def check_fp8_gemms(prepared: dict) -> dict:
    from ampbench import models, precision
    if torch.cuda.get_device_capability() < (8, 9):
        return {"figure": None, "passed": None, "detail": "no fp8 tensor cores (compute capability below 8.9)"}
    fp8 = precision.rung("fp8")
    found = fp8.census(models.build_meta(config.ModelConfig(arch="vit_tiny"), num_classes=10, image_size=32),
                       "tensorwise", 32)  # torch alone: the layers a forward calls, each [in, out, rows per image]
    need = fp8.images_multiple(found, "cuda")
    # every recipe's kind of GEMM: env_check allows rowwise on compute capability 12.x only where it ran here
    figure = {"multiple": need, "layers": len(found["layers"]),
              "recipes": {r: _recipe_gemm(r) for r in ("tensorwise", "rowwise")}}
    for batch, legal in ((15 * need, True), (15 * need + 1, False)):  # an odd multiple: a rule too lax fails
        gemms = {}
        for k, n, rows in found["layers"].values():
            m = batch * rows  # forward, the input's gradient, the weight's gradient (inner dimension: the rows)
            gemms.update({((m, k), (k, n)): False, ((m, n), (n, k)): False, ((n, m), (m, k)): True})
        errors, refused = [], []
        for (a, b), wgrad in gemms.items():
            try:
                errors.append(_fp8_gemm(a, b))
            except RuntimeError:
                refused.append(wgrad)
        figure[f"batch {batch}"] = {"gemms": len(gemms), "ran": len(errors), "refused": len(refused),
                                    "max_rel_err": max(errors, default=None)}
        ok = (not refused and max(errors) < 2e-2) if legal else (refused and all(refused)
                                                                 and len(refused) == sum(gemms.values()))
        if not ok:
            return {"figure": figure, "passed": False, "detail": f"batch {batch}: not what env_check expects"}
    return {"figure": figure, "passed": True, "detail": f"multiples of {need} images run; others refused in the "
                                                       "weight's gradient GEMM only"}


def check_launch_floor(prepared: dict) -> dict:
    import host_profile  # beside this script
    return host_profile.launch_floor()


def check_host_work(prepared: dict) -> dict:
    import host_profile  # beside this script
    return host_profile.check(prepared)


def _write(out: Path, info: dict, results: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"env": info, "checks": results}, indent=2, default=str) + "\n")
    lines = [f"# GPU validation: {(info.get('gpu') or {}).get('name', 'no GPU')}", "",
             f"`python {' '.join(sys.argv)}`, torch {torch.__version__}, CUDA {info.get('cuda_runtime')}, driver "
             f"{info.get('driver')}, {time.strftime('%Y-%m-%d')}.", "", "| check | result | figure | what |",
             "|---|---|---|---|"]
    for name, r in results.items():
        verdict = {True: "pass", False: "FAIL", None: "skipped"}[r["passed"]]
        lines.append(f"| {name} | {verdict} | `{json.dumps(r['figure'], default=str)[:300]}` | {CHECKS[name]} |")
    (out / "results.md").write_text("\n".join(lines) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results/gpu_validate", help="folder for results.json and .md")
    ap.add_argument("--dry-run", action="store_true", help="list the checks and exit")
    ap.add_argument("--only", nargs="*", choices=list(CHECKS), help="run these checks only")
    args = ap.parse_args()
    if args.dry_run:
        for name, what in CHECKS.items():
            print(f"{name}: {what}")
        return
    if not torch.cuda.is_available():
        sys.exit("error: no CUDA GPU here; gpu_validate checks what only a GPU can show (--dry-run lists them)")
    info = env.probe()
    prepared = data.synthetic_in_memory(4096, 1024, seed=0, device="cuda")
    results: dict = {}
    t0 = time.perf_counter()
    for name in args.only or CHECKS:
        start = time.perf_counter()
        try:
            results[name] = globals()[f"check_{name}"](prepared)
        except Exception as err:  # a check that crashes has failed; the others still run
            results[name] = {"figure": None, "passed": False, "detail": f"{type(err).__name__}: {str(err)[:300]}"}
        r = results[name]
        verdict = {True: "pass", False: "FAIL", None: "skipped"}[r["passed"]]
        print(f"{name}: {verdict} ({time.perf_counter() - start:.0f} s): {json.dumps(r['figure'], default=str)}"
              f" [{r['detail']}]", flush=True)
        _write(Path(args.out), info, results)
    print(f"{sum(r['passed'] is True for r in results.values())} passed, "
          f"{sum(r['passed'] is False for r in results.values())} failed in {time.perf_counter() - t0:.0f} s")
    if any(r["passed"] is False for r in results.values()):
        sys.exit(1)


if __name__ == "__main__":
    main()
