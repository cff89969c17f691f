"""runner.train under FSDP on 2 gloo ranks (test_distributed's helpers), as the train stage runs it: the same losses
and weights as DDP at fp32, fp16 and fp8, the weights whole and plain on rank 0, the audit and profile made; and a
checkpoint, whole, resumed into the shards to the same weights (fp8 with its loaded weights' scales); fp8 with a
frozen block, and fp8, fp32 and fp16 compiled block by block."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ampbench import config
from ampbench.train import fsdp
from tests.test_distributed import WORLD, _join, _model, _spawn


def _plan(variant: str, strategy: str, epochs: int = 2, compile: bool = False):
    from ampbench import runplan
    # fp8: a model whose blocks fp8 converts (the small CNN's Linear layers are its ends), fine-tuned: its first
    # block frozen (its weight converted and gathered in fp8 like the others', never updated)
    fp8 = variant == "fp8"
    model = {"factory": "tests.test_fsdp:mlp", "freeze": ["2"]} if fp8 else {"arch": "small_cnn"}
    cfg = config.from_dict({"device": "cpu", "model": model, "mlflow": {"enabled": False},
                            "train": {"epochs": epochs, "batch_size": 32, "warmup_steps": 0, "compile": compile},
                            "profile": {"steps": 1}, "amp": {"audit_batches": 1},
                            "distributed": {"nproc_per_node": WORLD, "strategy": strategy},
                            **({"variants": {"fp8": {"precision": "fp8"}}} if fp8 else {})})
    return runplan.make_plan(cfg, variant, "cpu")


def _runs_worker(rank: int, port: int, folder: str) -> None:
    """runner.train as the train stage runs it, DDP and FSDP, fp32, fp16 and fp8; and FSDP runs (fp32, fp8) resumed
    from their checkpoints after the first epoch."""
    from ampbench import data
    from ampbench.train import runner, setup
    from ampbench.train.engine import Trainer
    world = _join(rank, port)
    prepared = data.load_prepared(Path(folder) / "prepared", "cpu")
    out = {}
    for variant in ("fp32", "amp", "fp8"):
        for strategy in ("ddp", "fsdp"):
            result = runner.train(_plan(variant, strategy), prepared, progress=False, world=world)
            m = result.metrics
            out[f"{variant}_{strategy}"] = {
                "history": [[row["train_loss"], row["eval_loss"], row["eval_acc"]] for row in result.history],
                "weights": {k: v.tolist() for k, v in (result.weights or {}).items()},
                "plain": all(type(v) is torch.Tensor for v in (result.weights or {}).values()),
                "strategy": m["strategy"], "fsdp": m.get("fsdp"), "audited": bool(result.numerics),
                "profiled": "error" not in m["profile"], "not_made": m["not_made"]}
    start = setup.build(_plan("fp8", "ddp"), prepared["meta"], torch.device("cpu")).model.state_dict()  # its seeded
    out["fp8_start"] = {k: v.tolist() for k, v in start.items() if k[:2] in ("2.", "3.")}  # initial weights
    # compiled under FSDP, dynamo's graphs run with the eager kernels (aot_eager: the capture alone, which changes no
    # arithmetic; Inductor's own rounding is test_ddp_trainer's): fp8 as train.compile auto runs it on a GPU, and the
    # small CNN at fp32 (no policy: every block compiled) and at fp16 (each block holds a BatchNorm unit: eager)
    import functools

    from torch._dynamo.utils import counters
    inductor = torch.compile
    torch.compile = functools.partial(inductor, backend="aot_eager")
    for variant in ("fp8", "fp32", "amp"):  # their blocks' code shared: the third meets the first two's graphs
        counters.clear()
        result = runner.train(_plan(variant, "fsdp", compile=True), prepared, progress=False, world=world)
        out[f"{variant}_compiled"] = {
            "history": [[row["train_loss"], row["eval_loss"], row["eval_acc"]] for row in result.history],
            "weights": {k: v.tolist() for k, v in (result.weights or {}).items()},
            "compiled": result.metrics["compiled"], "not_made": result.metrics["not_made"],
            "fsdp": result.metrics["fsdp"], "graphs": counters["stats"]["unique_graphs"],
            "frames": dict(counters["frames"]), "breaks": sum(counters["graph_break"].values()),
            "all": {k: {str(a): b for a, b in v.items()} for k, v in counters.items()}}
    torch.compile = inductor
    # the checkpoint after the first epoch, whole, loaded into a fresh sharded trainer: the second epoch is the same
    # (fp8: its scales those of the loaded weights)
    for variant in ("fp32", "fp8"):
        plan = _plan(variant, "fsdp")
        first = Trainer(plan, prepared, progress=False, world=world)
        first.run_epoch()
        state = first.state_dict()  # every rank: a collective
        path = Path(folder) / "state.pt"
        if world.main:
            torch.save(state, path)
        world.barrier()
        # loaded into a trainer two epochs on (fp8: its scales of other weights, which a load must replace)
        second = Trainer(plan, prepared, progress=False, world=world)
        second.run_epoch()
        second.run_epoch()
        second.load_state_dict(torch.load(path, weights_only=True))
        first.run_epoch()
        second.run_epoch()
        out[f"{variant}_resumed_equal"] = all(
            torch.equal(fsdp.full(a.detach()), fsdp.full(b.detach()))
            for a, b in zip(first.model.parameters(), second.model.parameters(), strict=True))
        out[f"{variant}_state_plain"] = all(type(v) is torch.Tensor for v in state["model"].values())
        if variant == "fp32":
            out["state_whole"] = sorted(state["model"]) == sorted(_model().state_dict()) if world.main else None
        world.barrier()
    (Path(folder) / f"runs{rank}.json").write_text(json.dumps(out))
    torch.distributed.destroy_process_group()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from ampbench import data
    folder = tmp_path_factory.mktemp("fsdp-runs")
    data.prepare(config.DataConfig(source="synthetic", train_size=128, test_size=32), 0, folder / "prepared",
                 folder / "raw")
    _spawn(_runs_worker, str(folder))
    return [json.loads((folder / f"runs{r}.json").read_text()) for r in range(WORLD)]


def test_a_run_under_fsdp_trains_as_under_ddp_and_writes_its_whole_weights(runs):
    """runner.train end to end on 2 ranks: the same losses, accuracy and final weights as DDP at the same
    precision (fp32; fp16 with its GradScaler over the shards), the weights whole on rank 0, the numerics audit
    and the step profile made (on a whole copy, and on every rank), the sharding described in the metrics."""
    main = runs[0]
    for variant in ("fp32", "amp", "fp8"):
        ddp, sharded = main[f"{variant}_ddp"], main[f"{variant}_fsdp"]
        assert (ddp["strategy"], sharded["strategy"]) == ("ddp", "fsdp")
        torch.testing.assert_close(torch.tensor(sharded["history"]), torch.tensor(ddp["history"]), rtol=0, atol=0)
        assert sorted(sharded["weights"]) == sorted(ddp["weights"])
        for k, v in ddp["weights"].items():
            torch.testing.assert_close(torch.tensor(sharded["weights"][k]), torch.tensor(v), rtol=0, atol=0, msg=k)
        assert sharded["profiled"] and not sharded["not_made"], sharded["not_made"]
        assert sharded["fsdp"]["blocks"] == (["1", "2", "3", "4"] if variant == "fp8" else ["0", "2", "4", "7"])
    assert main["amp_fsdp"]["audited"] and main["amp_fsdp"]["fsdp"]["param_dtype"] == "float16"
    assert main["amp_fsdp"]["fsdp"]["reduce_dtype"] == "float32"
    # model.pt holds plain tensors (fp8's weights come from FSDP as torchao's subclass): it loads with weights_only
    # where torchao is not imported
    assert all(main[f"{v}_fsdp"]["plain"] for v in ("fp32", "amp", "fp8"))
    fp8 = main["fp8_fsdp"]["fsdp"]  # its converted weights gathered in fp8, the rest of a block in bf16
    assert fp8["param_dtype"] == "bfloat16" and fp8["wire_bytes_per_step"]["all_gather"]["by_dtype"]["float8_e4m3fn"]
    assert runs[1]["fp32_fsdp"]["weights"] == {}  # rank 0 alone writes


def test_fp8_with_a_frozen_block_under_fsdp_leaves_the_block_as_it_was(runs):
    """Fine-tuning under FSDP in fp8 (the fp8 runs above, DDP's equal bit for bit): a frozen block's weight is
    converted and gathered in fp8 like the others but gets no gradient; it ends as it began, and it is counted out
    of the trained parameters."""
    from tests.test_fsdp import mlp
    sharded, start = runs[0]["fp8_fsdp"], runs[0]["fp8_start"]
    assert sorted(start) == ["2.0.bias", "2.0.weight", "3.0.bias", "3.0.weight"]
    for k in ("2.0.bias", "2.0.weight"):  # the frozen block as it began
        assert sharded["weights"][k] == start[k], k
    assert sharded["weights"]["3.0.weight"] != start["3.0.weight"]  # the next block trained
    model = mlp()
    frozen = sum(q.numel() for q in model[2].parameters())
    assert sharded["fsdp"]["trained_count"] == sum(q.numel() for q in model.parameters()) - frozen


def test_an_fsdp_checkpoint_is_whole_and_resumes_to_the_same_weights(runs):
    assert runs[0]["state_whole"]
    assert all(r["fp32_resumed_equal"] and r["fp8_resumed_equal"] for r in runs)
    assert all(r["fp32_state_plain"] and r["fp8_state_plain"] for r in runs)


def test_compiled_under_fsdp_each_block_is_one_graph_and_trains_as_eager(runs):
    """train.compile under FSDP: each block's forward captured whole (FSDP's hooks eager around it: no graph break,
    no frame given up), the root's own layers eager; with the eager kernels (aot_eager) the same losses and weights
    as the eager FSDP run bit for bit, and the same state dict names. A block holding a BatchNorm unit of its own
    (the small CNN's stages under fp16) stays eager and is named."""
    main = runs[0]
    for variant in ("fp8", "fp32", "amp"):
        compiled, eager = main[f"{variant}_compiled"], main[f"{variant}_fsdp"]
        assert compiled["compiled"] and not compiled["not_made"], compiled["not_made"]
        frames = compiled["frames"]
        assert compiled["breaks"] == 0 and frames.get("total") == frames.get("ok"), compiled["all"]
        torch.testing.assert_close(torch.tensor(compiled["history"]), torch.tensor(eager["history"]), rtol=0, atol=0)
        assert sorted(compiled["weights"]) == sorted(eager["weights"])
        for k, v in eager["weights"].items():
            torch.testing.assert_close(torch.tensor(compiled["weights"][k]), torch.tensor(v), rtol=0, atol=0, msg=k)
    f = {v: main[f"{v}_compiled"]["fsdp"] for v in ("fp8", "fp32", "amp")}
    assert (f["fp8"]["compiled_blocks"], f["fp8"]["eager_blocks"]) == (["1", "2", "3", "4"], [])
    assert (f["fp32"]["compiled_blocks"], f["fp32"]["eager_blocks"]) == (["0", "2", "4", "7"], [])
    assert (f["amp"]["compiled_blocks"], f["amp"]["eager_blocks"]) == (["7"], ["0", "2", "4"])  # the head: no BN
    # a graph per distinct block or more (the mlp's two 64-wide blocks are alike: one graph may serve both)
    assert main["fp8_compiled"]["graphs"] >= 3 and main["fp32_compiled"]["graphs"] >= 4
