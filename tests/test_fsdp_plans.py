"""FSDP's plans and blocks, without processes: the repeated blocks sharded on their own, what FSDP does not run yet
refused in one line, SGD's foreach taken where auto would fuse it, accumulation's whole gradients counted, the
demo's data-parallel variants under a default fsdp strategy."""

from __future__ import annotations

import re

import pytest

from ampbench import config, models
from ampbench.train import fsdp
from tests.test_distributed import WORLD, _model


def test_the_blocks_sharded_are_the_repeated_ones():
    names = {arch: [n for n, _ in fsdp.blocks(models.build(config.ModelConfig(arch=arch), num_classes=10,
                                                              image_size=32, device="cpu"))]
             for arch in ("small_cnn", "resnet18", "vit_tiny")}
    assert names["small_cnn"] == ["0", "2", "4", "7"]  # no repeated class: the stages with parameters
    assert names["resnet18"] == [f"layer{i}.{j}" for i in range(1, 5) for j in range(2)]
    assert names["vit_tiny"] == [f"encoder.layers.encoder_layer_{i}" for i in range(6)]


@pytest.mark.parametrize(("variant", "train", "said"), [
    ({"precision": "bf16", "grad_comm": "fp16"}, {}, "grad_comm fp16 is DDP's gradient compression"),
    ({"precision": "fp8", "recipe": "rowwise"}, {}, "fp8 recipe 'rowwise' under FSDP: torchao all-gathers its weights "
     "in their own format with the tensorwise recipe only; set recipe: tensorwise, or give"),
    ({"precision": "mxfp8"}, {}, "precision mxfp8 has no all-gather of its own format under FSDP"),
    ({"precision": "bf16"}, {"optimizer": "adafactor"}, "adafactor's factored state does not run"),
    ({"precision": "bf16", "optimizer_impl": "fused"}, {}, "optimizer_impl fused has no kernel for FSDP's"),
])
def test_what_fsdp_does_not_run_yet_is_refused_in_one_line(variant, train, said):
    from ampbench import runplan
    from ampbench.errors import ConfigError
    cfg = config.from_dict({"device": "cpu", "train": train, "variants": {"v": {**variant, "strategy": "fsdp"}},
                            "distributed": {"nproc_per_node": 2}})
    with pytest.raises(ConfigError, match=f"^variant 'v' \\(strategy: fsdp\\): {said}") as err:
        runplan.make_plan(cfg, "v", "cpu")
    assert "\n" not in str(err.value)


def test_fsdp_takes_sgd_s_foreach_where_auto_would_fuse_it_and_counts_accumulation_s_whole_gradients():
    """On CUDA auto picks SGD's fused kernel, which has no rule for DTensor shards: FSDP's plan takes foreach
    (DDP's keeps fused). With accumulation every gradient is held whole until the last micro-batch: counted."""
    from ampbench import runplan
    cfg = config.from_dict({"device": "cuda", "variants": {"f": {"precision": "bf16", "strategy": "fsdp"},
                                                           "d": {"precision": "bf16"}},
                            "distributed": {"nproc_per_node": 2}})
    assert runplan.make_plan(cfg, "f", "cuda").train.optimizer_impl == "foreach"
    # fp8 compiles by default on CUDA (train.compile auto), under FSDP too (each block: fsdp.compile_blocks)
    fp8 = config.from_dict({"device": "cuda", "variants": {"f": {"precision": "fp8", "strategy": "fsdp"},
                                                           "d": {"precision": "fp8"}},
                            "distributed": {"nproc_per_node": 2}})
    assert runplan.make_plan(fp8, "f", "cuda").train.compile and runplan.make_plan(fp8, "d", "cuda").train.compile
    assert runplan.make_plan(cfg, "d", "cuda").train.optimizer_impl == "fused"
    model = _model()
    trained = sum(q.numel() for q in model.parameters())
    one, four = (fsdp.memory_parts(model, WORLD, "bf16", "fp32", 1, accum) for accum in (1, 4))
    assert "accumulated_gradients" not in one and four["accumulated_gradients"] == 4 * trained


def test_the_demo_s_data_parallel_variants_plan_under_a_default_fsdp_strategy():
    """`ampbench demo --nproc-per-node 2` with distributed.strategy: fsdp: its fp16-communication variant is DDP's
    (the hook), its one-process baselines are not sharded, and every variant plans."""
    from ampbench import runplan, sandbox
    params = sandbox.data_parallel(sandbox.merge(sandbox.demo_params(), {"distributed": {"strategy": "fsdp"}}), 2)
    cfg = config.from_dict(params)
    plans = {name: runplan.make_plan(cfg, name, "cpu") for name in cfg.variants}
    assert {n: (p.strategy, p.ddp) for n, p in plans.items() if n.endswith(("_fp16comm", "_1proc"))} == {
        "fp32_fp16comm": ("ddp", True), **{n: ("fsdp", False) for n in plans if n.endswith("_1proc")}}


def test_the_report_sets_each_fsdp_variant_beside_ddp_s_counts_and_says_what_its_precision_bought():
    """No DDP run of bf16 (the done-means' set: FSDP fp32, bf16, fp16 beside DDP fp32): bf16 is still set beside
    DDP's counts (DDP sends fp32 gradients whatever the autocast), and against FSDP fp32 its gathers' savings in
    memory per rank and bytes sent; the verdict says both."""
    from ampbench.report import sharded
    from ampbench.train.fsdp import memory_parts, wire_bytes
    model = _model()
    n = sum(q.numel() for q in model.parameters())
    metrics, rows = {}, []
    for name, precision, strategy in (("f32", "fp32", "fsdp"), ("f16", "bf16", "fsdp"), ("d32", "fp32", "ddp")):
        f = {"param_count": n, "trained_count": n, "state_per_param": 1, "param_dtype": "float32",
             "reduce_dtype": "float32", "wire_bytes_per_step": wire_bytes(model, 2, precision),
             "memory_per_rank": memory_parts(model, 2, precision)}
        if precision == "bf16":
            f["param_dtype"] = "bfloat16"
        metrics[name] = {"precision": precision, "accum_steps": 1, "peak_mem_bytes": 1 << 20,
                         **({"fsdp": f} if strategy == "fsdp" else {})}
        rows.append({"variant": name, "strategy": strategy, "world_size": 2, "grad_comm": None, "imgs_per_s": 100.0,
                     "final_acc": 0.5, "peak_mem_bytes": 1 << 20})
    found = sharded.against_fp32([sharded.against_ddp(r, rows, metrics) for r in rows if r["strategy"] == "fsdp"])
    f32, f16 = found
    assert f32["against"] == "d32" and f16["against"] is None  # a throughput beside DDP only at the same precision
    # DDP: the parameters, gradients, buckets and momentum, whole; its fp32 all-reduce on 2 ranks
    assert f16["against_memory_per_rank"] == f32["against_memory_per_rank"] == 4 * n * 4
    assert f16["against_wire_bytes_per_step"] == 2 * n * 4 // 2
    assert f16["fp32_variant"] == "f32" and "fp32_variant" not in f32
    assert f16["wire_bytes_per_step"] < f32["wire_bytes_per_step"]
    text = "\n".join(sharded.lines(found))
    assert re.search(r"bf16 gathers hold \d+% less memory per rank and send \d+% less bytes\.", text)
    assert "(DDP's all-reduce of the fp32 gradients)" in text
    verdict = sharded.verdict_sentence(found)
    assert verdict.startswith(" Sharded with FSDP (counted): f32 held ")
    assert re.search(r"; f16 \(bf16 gathers\) held \d+% less memory per rank and sent \d+% less bytes against "
                     r"f32\.$", verdict), verdict
    # fp8's converted weights gathered in fp8 beside the rest in bf16: said so, not "bf16"
    assert "compiled" not in text  # eager: nothing said
    # fp8's converted weights gathered in fp8 beside the rest in bf16: said so, not "bf16"
    fp8 = dict(f16, wire={"all_gather": {"by_dtype": {"bfloat16": 10, "float8_e4m3fn": 5, "float32": 1}}})
    assert sharded.gathered(fp8) == "float8 and bf16" and sharded.sent(fp8) == "fp32 reduce-scatter, float8 and bf16 "\
        "all-gather"
    # compiled under FSDP: block by block, which the head says, with any block left eager, and beside a DDP model
    # compiled whole, that the throughput sets those apart too
    said = sharded.lines([dict(f32, compiled_blocks=["7"], eager_blocks=["0", "2"], against_compiled=True)])[0]
    assert said.startswith("FSDP (`f32`, 2 processes, fp32 gathered, fp32 reduced, 1 of 3 blocks compiled, the "
                           "root's own layers eager (left eager: 0, 2, each holding a BatchNorm sharded apart)) "
                           "against DDP (`d32`, gradients all-reduced in fp32, compiled whole, where FSDP's blocks "
                           "left eager are not: the throughput sets the two apart too): "), said
    # and an fp8 run whose blocks all stayed eager is labelled eager in the summary, as an uncompiled one is
    from ampbench.report import summary
    run = {"metrics": {"precision": "fp8", "compiled": True, "fsdp": {"compiled_blocks": [], "eager_blocks": ["0"]}},
           "history": []}
    assert (summary._variant("f8", run, None, 0)["eager"], summary._variant("f8", run, None, 0)["compiled"]) == (
        True, False)


def test_compiled_blocks_keep_their_graphs_through_training_and_evaluation_s_shapes(monkeypatch):
    """A ResNet-18's 8 blocks share BasicBlock's code, and each of its distinct blocks needs a graph per shape and
    grad mode (training's batch; evaluation's, its last, a rank's empty slice): about 30 here, past dynamo's default
    limit of 8, at which the rest ran eager. compile_blocks gives them room: no frame given up. (dynamo's capture
    alone, the eager backend: what the limit counts.)"""
    import functools

    import torch
    from torch._dynamo.utils import counters
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))
    model = models.build(config.ModelConfig(arch="resnet18"), num_classes=10, image_size=32, device="cpu")
    assert fsdp.compile_blocks(model, "fp32") == ([n for n, _ in fsdp.blocks(model)], [])
    counters.clear()
    model(torch.randn(8, 3, 32, 32)).sum().backward()
    model.eval()
    with torch.no_grad():
        for n in (8, 5, 0):
            model(torch.randn(n, 3, 32, 32))
    assert counters["stats"]["unique_graphs"] > 8 and counters["frames"]["total"] == counters["frames"]["ok"]
    # under a policy its BatchNorm layers are FSDP units of their own: every block stays eager, said
    bf16 = models.build(config.ModelConfig(arch="resnet18"), num_classes=10, image_size=32, device="cpu")
    assert fsdp.compilable(bf16, "bf16") == ([], [n for n, _ in fsdp.blocks(bf16)])
