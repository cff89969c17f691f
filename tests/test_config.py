"""params.yaml validation: every bad value is one clear line naming the key and the fix."""

from __future__ import annotations

import copy

import pytest

from ampbench import config, runplan
from ampbench.errors import ConfigError


def test_committed_params_are_the_articles_experiment(real_params):
    cfg = config.from_dict(real_params)
    assert cfg.data.source == "cifar10" and cfg.model.arch == "resnet18"
    assert cfg.train.batch_size == 256 and cfg.amp.init_scale == 8192 and cfg.amp.growth_interval == 2000
    assert {n: (v.precision, v.accum_steps) for n, v in cfg.variants.items()} == {
        "fp32": ("fp32", 1), "tf32": ("tf32", 1), "amp": ("fp16", 1), "amp_accum": ("fp16", 4)}
    assert "allow_tf32" not in real_params["train"]  # TF32 is a precision of its own, set in each plan


def test_an_old_allow_tf32_still_loads_with_one_line_saying_what_to_write(capsys):
    from ampbench import runplan
    cfg = config.from_dict({"train": {"allow_tf32": False}, "variants": {"fp32": {"precision": "fp32"}}})
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "delete train.allow_tf32" in err and "precision: tf32" in err
    assert cfg.variants["fp32"].precision == "fp32" and cfg.train.allow_tf32 is False
    # true meant "my fp32 runs TF32": a tf32 variant runs beside the fp32 one, which stays the strict baseline
    cfg = config.from_dict({"train": {"allow_tf32": True},
                            "variants": {"base": {"precision": "fp32"}, "amp": {"precision": "fp16"}}})
    assert "a tf32 variant now runs beside the fp32 ones" in capsys.readouterr().err
    assert {n: v.precision for n, v in cfg.variants.items()} == {"base": "fp32", "amp": "fp16", "tf32": "tf32"}
    assert runplan.make_plan(cfg, "tf32", "cpu").train.allow_tf32 is True
    assert runplan.make_plan(cfg, "base", "cpu").train.allow_tf32 is False
    with pytest.raises(ConfigError, match="train.allow_tf32 = 'yes' is not true or false"):
        config.from_dict({"train": {"allow_tf32": "yes"}})


def test_each_plan_sets_tf32_from_its_precision_and_the_other_plans_are_unchanged():
    """Only the tf32 plan turns TF32 on; fp32 and fp16 plans keep the field they always had (false), so an
    existing pipeline does not retrain them."""
    from ampbench import runplan
    cfg = config.Config()
    plans = {n: config.to_dict(runplan.make_plan(cfg, n, "cuda")) for n in cfg.variants}
    assert {n: p["train"]["allow_tf32"] for n, p in plans.items()} == {
        "fp32": False, "tf32": True, "amp": False, "amp_accum": False}
    assert runplan.for_precision(cfg, "tf32", "cuda").train.allow_tf32 is True


def test_every_field_has_a_default_matching_params_yaml(real_params):
    """The dataclass defaults and the committed file agree, so a missing key means the documented value."""
    assert config.to_dict(config.Config()) == config.to_dict(config.from_dict(real_params))


def test_int_accepted_where_float_expected(real_params):
    real_params["train"]["lr"] = 1
    assert config.from_dict(real_params).train.lr == 1.0


def test_bf16_variant_needs_no_code(real_params):
    real_params["variants"]["bf16"] = {"precision": "bf16", "accum_steps": 1}
    assert config.from_dict(real_params).variants["bf16"].precision == "bf16"


def _set(d: dict, dotted: str, value):
    *path, last = dotted.split(".")
    for key in path:
        d = d[key]
    d[last] = value


# Values params.yaml may hold but its data source refuses (at env_check, through data.describe): the source
# checks its own files, once.
SOURCE_BAD = [
    ({"data.source": "folder", "data.path": "/nonexistent/images"}, ["data.path", "no such folder"]),
    ({"data.archive": "/nonexistent/cifar.tgz"}, ["data.archive", "no such file"]),
]
BAD = [  # (key, value, words the message must contain)
    ("device", "gpu", ["device", "'gpu'", "auto | cuda | cpu"]),
    ("seed", -1, ["seed", ">= 0"]),
    ("seed", 1.5, ["seed", "integer"]),
    ("data.source", "imagenet", ["data.source", "cifar10 | cifar100 | folder | synthetic"]),
    ("data.source", "folder", ["data.source = 'folder' needs data.path"]),
    ("data.image_size", 4, ["data.image_size", ">= 8"]),
    ("data.url", "ftp://x/y.tgz", ["data.url", "http"]),
    ("data.url", "not a url", ["data.url"]),
    ("data.md5", "xyz", ["data.md5", "32 hex"]),
    ("data.train_size", -5, ["data.train_size", ">= 0"]),
    ("data.test_size", "all", ["data.test_size", "integer"]),
    ("model.arch", "vit", ["model.arch", "resnet18 | small_cnn | vit_tiny | tv:<torchvision model>"]),
    ("model.arch", "tv:", ["model.arch", "tv:resnet50"]),
    ("model.factory", "models/my_net.py", ["model.factory", "package.module:function"]),
    ("model.input_size", -1, ["model.input_size", ">= 0"]),
    ("model.channels_last", "yes", ["model.channels_last", "true or false"]),
    ("train.epochs", 0, ["train.epochs", ">= 1"]),
    ("seed", 2 ** 70, ["seed = 1180591620717411303424", "<= 2147483647"]),  # torch's generator would overflow
    ("variants.amp.strategy", "fsdp", ["variants.amp.strategy = 'fsdp' shards the model over processes",
                                       "nproc_per_node = 1", "strategy: ddp"]),
    ("distributed.strategy", "fsdp", ["distributed.strategy = 'fsdp'", "set nproc_per_node to 2 or more"]),
    ("train.batch_size", "256", ["train.batch_size", "integer"]),
    ("train.batch_size", 0, ["train.batch_size", ">= 1"]),
    ("train.lr", 0, ["train.lr", "> 0"]),
    ("train.lr", "fast", ["train.lr", "number"]),
    ("train.lr", float("nan"), ["train.lr = nan", "not a finite number"]),
    ("amp.init_scale", float("inf"), ["amp.init_scale = inf", "not a finite number"]),
    ("train.betas", [0.9, float("-inf")], ["train.betas[1] = -inf", "not a finite number"]),
    ("train.momentum", 1.0, ["train.momentum", "< 1"]),
    ("train.weight_decay", -0.1, ["train.weight_decay", ">= 0"]),
    ("train.optimizer", "adam", ["train.optimizer", "sgd | adamw"]),
    ("train.betas", [0.9, 1.0], ["train.betas[1]", "< 1"]),
    ("train.eps", 0, ["train.eps", "> 0"]),
    ("train.clip_grad_norm", -1, ["train.clip_grad_norm", ">= 0"]),
    ("train.optimizer_impl", "apex", ["train.optimizer_impl", "auto | fused | foreach | for_loop"]),
    ("train.warmup_steps", True, ["train.warmup_steps", "integer"]),
    ("amp.init_scale", 0, ["amp.init_scale", "> 0"]),
    ("amp.growth_factor", 1.0, ["amp.growth_factor", "> 1"]),
    ("amp.backoff_factor", 1.5, ["amp.backoff_factor", "< 1"]),
    ("amp.growth_interval", 0, ["amp.growth_interval", ">= 1"]),
    ("mlflow.experiment", "  ", ["mlflow.experiment", "empty"]),
    ("mlflow.enabled", "no", ["mlflow.enabled", "true or false"]),
    ("variants", {}, ["variants", "non-empty"]),
    ("variants", ["fp32"], ["variants", "mapping"]),
    ("variants.amp.precision", "fp64", ["variants.amp.precision", "fp32 | tf32 | fp16 | bf16"]),
    ("variants.amp_accum.accum_steps", 3, ["accum_steps = 3", "train.batch_size = 256", "divisor"]),
    ("variants.amp.accum_steps", 0, ["variants.amp.accum_steps", ">= 1"]),
    ("train.bogus", 1, ["unknown key 'train.bogus'", "allowed here"]),
    ("bogus", 1, ["unknown key 'bogus'"]),
    ("variants.amp.bogus", 1, ["unknown key 'variants.amp.bogus'"]),
    ("amp", 5, ["amp", "mapping"]),
    ("sweep.batch_sizes", [], ["sweep.batch_sizes", "empty"]),
    ("sweep.batch_sizes", [8, 0], ["sweep.batch_sizes[1]", ">= 1"]),
    ("sweep.batch_sizes", [8, 8], ["sweep.batch_sizes", "repeats"]),
    ("sweep.batch_sizes", 64, ["sweep.batch_sizes", "not a list"]),
    ("sweep.precisions", ["fp64"], ["sweep.precisions[0]", "fp32 | tf32 | fp16 | bf16"]),
    ("sweep.memory_limit_gib", -1, ["sweep.memory_limit_gib", ">= 0"]),
    ("distributed.nproc_per_node", 0, ["distributed.nproc_per_node", ">= 1"]),
    ("distributed.backend", "mpi", ["distributed.backend", "auto | nccl | gloo"]),
    ("distributed.grad_comm", "int8", ["distributed.grad_comm", "none | fp16 | bf16"]),
    ("variants.amp.grad_comm", "fp8", ["variants.amp.grad_comm", '"" | none | fp16 | bf16']),
    ("variants.amp.ddp", "no", ["variants.amp.ddp", "true or false"]),
    ("distributed.find_unused_parameters", "yes", ["distributed.find_unused_parameters", "true or false"]),
    ("distributed.nproc_per_node", 3, ["train.batch_size = 256", "nproc_per_node = 3", "multiple of 3"]),
]


@pytest.mark.parametrize(("key", "value", "words"), BAD, ids=[f"{k}={v!r}" for k, v, _ in BAD])
def test_bad_value_names_key_value_and_fix(real_params, key, value, words):
    params = copy.deepcopy(real_params)
    _set(params, key, value)
    with pytest.raises(ConfigError) as err:
        config.from_dict(params)
    msg = str(err.value)
    assert "\n" not in msg
    for word in words:
        assert word in msg, msg


def test_empty_and_broken_files(tmp_path):
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    with pytest.raises(ConfigError, match="empty"):
        config.load(empty)
    broken = tmp_path / "broken.yaml"
    broken.write_text("train:\n  epochs: 3\n batch_size: [\n")
    with pytest.raises(ConfigError, match="broken YAML at line"):
        config.load(broken)
    with pytest.raises(ConfigError, match="no such file"):
        config.load(tmp_path / "missing.yaml")


def test_plan_holds_only_what_the_variant_reads(real_params, tmp_path):
    cfg = config.from_dict(real_params)
    fp32, amp = runplan.make_plan(cfg, "fp32", "cpu"), runplan.make_plan(cfg, "amp", "cpu")
    assert fp32.amp is None and amp.amp == cfg.amp
    runplan.write_plan(amp, tmp_path / "amp.json")
    assert runplan.read_plan(tmp_path / "amp.json") == amp
    real_params["amp"]["init_scale"] = 1024
    cfg2 = config.from_dict(real_params)
    assert runplan.make_plan(cfg2, "fp32", "cpu") == fp32  # fp32's plan, and so its stage, does not change
    assert runplan.make_plan(cfg2, "amp", "cpu") != amp
