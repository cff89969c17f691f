"""Fine-tuning: pretrained weights (torchvision's through torch hub's cache, or a state dict file), frozen layers
(``model.freeze``, ``model.freeze_bn``, or a factory's own), and what every analysis makes of them."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import yaml

from ampbench import config, data, models, results, runplan
from ampbench.config import ModelConfig
from ampbench.errors import ConfigError
from ampbench.models import finetune
from ampbench.sandbox import REPO_ROOT
from ampbench.train import distributed, numerics, runner, setup
from ampbench.train.engine import Trainer
from tests.test_distributed import WORLD, _join, _ranks


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """torch hub's cache in ``tmp_path`` (TORCH_HOME), holding a locally made state dict where torchvision's
    ResNet-18 IMAGENET1K_V1 file goes (its name fixed by the weights' URL), and no network: a download fails."""
    import torchvision
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))

    def offline(url, dst, *args, **kwargs):
        raise OSError(f"no network here (asked for {url})")
    monkeypatch.setattr(torch.hub, "download_url_to_file", offline)
    weights = torchvision.models.ResNet18_Weights.IMAGENET1K_V1
    path = finetune.cached_file(weights)
    assert path == tmp_path / "torch" / "hub" / "checkpoints" / "resnet18-f37072fd.pth"
    path.parent.mkdir(parents=True)
    torch.manual_seed(1)
    state = torchvision.models.resnet18().state_dict()  # 1000 classes, as the real file
    torch.save(state, path)
    return path, state


def test_torchvision_weights_load_from_the_hub_cache_with_a_new_head_and_a_frozen_backbone(hub, capsys):
    path, state = hub
    cfg = ModelConfig(arch="tv:resnet18", weights="IMAGENET1K_V1", freeze=("backbone",), freeze_bn=True)
    info = models.check(cfg, num_classes=10, image_size=32)
    assert "its final layer fc made anew for the data's 10 classes" in capsys.readouterr().out
    assert info["trainable_param_count"] == 512 * 10 + 10 and info["param_count"] > 11_000_000
    model = models.build(cfg, num_classes=10, image_size=32, device="cpu")
    own = model.state_dict()
    assert all(torch.equal(own[k], v) for k, v in state.items() if not k.startswith("fc."))  # loaded strictly
    assert own["fc.weight"].shape == (10, 512)
    assert [n for n, p in model.named_parameters() if p.requires_grad] == ["fc.weight", "fc.bias"]
    bn = model.bn1
    before = bn.running_mean.clone()
    model.train()(torch.randn(4, 3, 32, 32))
    assert torch.equal(bn.running_mean, before) and not bn.training  # freeze_bn: eval mode through train()
    pickle.dumps(model)  # the LoggedModel pickles it: the eval hook is a module-level function
    # the identity of the weights goes where the model's does; a LoggedModel rebuilds without fetching them
    assert models.source_record(cfg)["weights"] == "ResNet18_Weights.IMAGENET1K_V1"
    path.unlink()
    again = models.build(cfg, num_classes=10, image_size=32, device="cpu", pretrained=False)
    assert [n for n, p in again.named_parameters() if p.requires_grad] == ["fc.weight", "fc.bias"]
    with pytest.raises(ConfigError, match=r"IMAGENET1K_V1 is not in torch hub's cache and could not be downloaded "
                                          r"\(OSError: no network here .*\); place resnet18-f37072fd.pth .* at "
                                          + str(path).replace(".", r"\.")):
        models.check(cfg, num_classes=10, image_size=32)
    with pytest.raises(ConfigError, match="resnet18's weights are IMAGENET1K_V1, DEFAULT; pick one"):
        models.check(ModelConfig(arch="tv:resnet18", weights="IMAGENET9K"), num_classes=10, image_size=32)
    with pytest.raises(ConfigError, match="names torchvision weights, which only a tv: model has"):
        models.check(ModelConfig(arch="small_cnn", weights="DEFAULT"), num_classes=10, image_size=32)


def test_weights_trained_at_224_on_32_pixel_data_are_said_with_the_fix(hub):
    note = finetune.input_note(ModelConfig(arch="tv:resnet18", weights="DEFAULT"), 32)
    assert "trained on 224x224 images and are fed 32x32 here" in note and "model.input_size: 224" in note
    assert finetune.input_note(ModelConfig(arch="tv:resnet18", weights="DEFAULT", input_size=224), 224) is None


def test_a_state_dict_file_loads_strictly_but_for_a_head_of_another_class_count(tmp_path, capsys):
    torch.manual_seed(0)
    trained = models.build(ModelConfig(arch="small_cnn"), num_classes=4, image_size=32, device="cpu")
    torch.save(trained.state_dict(), tmp_path / "w.pt")
    cfg = ModelConfig(arch="small_cnn", weights=str(tmp_path / "w.pt"), freeze=("0", "2"))
    models.check(cfg, num_classes=10, image_size=32)
    assert "the weights' final layer 7 (4 classes) made anew for the data's 10 classes" in capsys.readouterr().out
    model = models.build(cfg, num_classes=10, image_size=32, device="cpu")
    assert torch.equal(model[0][0].weight, trained[0][0].weight) and model[7].weight.shape == (10, 64)
    assert not model[0][0].weight.requires_grad and not model[2][0].weight.requires_grad
    assert model[4][0].weight.requires_grad and model[7].weight.requires_grad
    digest = models.source_hash(cfg)
    assert digest and models.source_record(cfg)["weights"].startswith("sha256:")
    torch.save({k: v + 1 for k, v in trained.state_dict().items()}, tmp_path / "w.pt")
    assert models.source_hash(cfg) != digest  # other weights in the same file: the train stages rerun
    state = trained.state_dict()
    state["extra.weight"] = state.pop("0.0.weight")
    torch.save(state, tmp_path / "bad.pt")
    with pytest.raises(ConfigError, match=r"does not fit small_cnn: missing 0\.0\.weight; unexpected extra\.weight"):
        models.check(ModelConfig(arch="small_cnn", weights=str(tmp_path / "bad.pt")), num_classes=4, image_size=32)
    with pytest.raises(ConfigError, match="model.weights = .*nope.pt.: no such file"):
        models.check(ModelConfig(arch="small_cnn", weights=str(tmp_path / "nope.pt")), num_classes=4, image_size=32)
    with pytest.raises(ConfigError, match=r"model.freeze names 'features', which holds no parameter of small_cnn; "
                                          r"name a module, e.g. one of 0, 2, 4, 7"):
        models.check(ModelConfig(arch="small_cnn", freeze=("features",)), num_classes=4, image_size=32)


@pytest.mark.parametrize(("arch", "head"), [("tv:mobilenet_v3_small", "classifier.3"), ("vit_tiny", "heads.head"),
                                            ("tv:resnet18", "fc"), ("tv:convnext_tiny", "classifier.2"),
                                            ("tv:squeezenet1_1", "classifier.1")])  # a 1x1 convolution
def test_backbone_is_everything_but_the_last_classification_layer_the_forward_runs(arch, head):
    model = models.build_meta(ModelConfig(arch=arch, freeze=("backbone",)), num_classes=10, image_size=32)
    assert {n for n, p in model.named_parameters() if p.requires_grad} == {f"{head}.weight", f"{head}.bias"}


def test_a_convolution_head_of_another_class_count_is_made_anew(tmp_path, capsys):
    torch.manual_seed(0)
    trained = models.build(ModelConfig(arch="tv:squeezenet1_1"), num_classes=4, image_size=32, device="cpu")
    torch.save(trained.state_dict(), tmp_path / "w.pt")
    cfg = ModelConfig(arch="tv:squeezenet1_1", weights=str(tmp_path / "w.pt"), freeze=("backbone",))
    models.check(cfg, num_classes=10, image_size=32)
    assert "final layer classifier.1 (4 classes) made anew for the data's 10 classes" in capsys.readouterr().out
    model = models.build(cfg, num_classes=10, image_size=32, device="cpu")
    assert model.classifier[1].weight.shape == (10, 512, 1, 1) and model(torch.randn(2, 3, 32, 32)).shape == (2, 10)
    assert torch.equal(model.features[0].weight, trained.features[0].weight) and model.classifier[1].bias.requires_grad


FACTORY = """
import torch, torchvision
from torch import nn

def build(num_classes):
    m = torchvision.models.mobilenet_v3_small()
    m.load_state_dict(torch.load(__file__.replace("my_ft.py", "mnv3.pt"), weights_only=True))
    print("loaded the pretrained weights")
    for p in m.features.parameters():
        p.requires_grad = False
    m.classifier[3] = nn.Linear(m.classifier[3].in_features, num_classes)
    return m
"""


def test_a_factory_that_loads_weights_builds_its_meta_copy_without_a_warning_per_tensor(tmp_path, monkeypatch,
                                                                                         capsys):
    import torchvision
    (tmp_path / "ft").mkdir()
    (tmp_path / "ft" / "my_ft.py").write_text(FACTORY)
    torch.save(torchvision.models.mobilenet_v3_small().state_dict(), tmp_path / "ft" / "mnv3.pt")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = ModelConfig(factory="ft.my_ft:build")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        model = models.build_meta(cfg, num_classes=10, image_size=32)
    assert not [w for w in seen if "meta parameter" in str(w.message)]  # 122 of them before
    assert "loaded the pretrained weights" not in capsys.readouterr().out  # the model check prints it, once
    assert not any(p.requires_grad for p in model.features.parameters())


def test_the_audit_and_the_optimizer_of_a_frozen_backbone(tiny_data_frozen):
    """The fp16 numerics audit's rows share one schema (a frozen layer has no gradient: its gradient columns are
    empty, not missing), so the run folder writes; the optimizer holds the trained parameters alone."""
    plan, prepared = tiny_data_frozen
    s = setup.build(plan, prepared["meta"], torch.device("cpu"))
    trained = [p for p in s.model.parameters() if p.requires_grad]
    assert [p for g in s.opt.param_groups for p in g["params"]] == trained
    assert set(s.opt.state) == set(trained)  # SGD's momentum primed for those alone
    x, y = torch.randn(8, 3, 32, 32), torch.randint(0, 10, (8,))
    rows = numerics.audit(s.model, [(x, y)], 8192.0, "cpu")
    assert all(tuple(r) == results.NUMERICS_COLUMNS for r in rows)
    frozen = {r["layer"]: r for r in rows if r["frozen"]}
    assert "0.0" in frozen and frozen["0.0"]["grad_underflow"] is None and frozen["0.0"]["act_underflow"] is not None
    assert rows[-1]["layer"] == "7" and not rows[-1]["frozen"] and rows[-1]["grad_underflow"] is not None


@pytest.fixture
def tiny_data_frozen(tmp_path):
    data.prepare(config.DataConfig(source="synthetic", train_size=64, test_size=32), 0, tmp_path, tmp_path / "raw")
    cfg = config.from_dict({"device": "cpu", "model": {"arch": "small_cnn", "freeze": ["0", "2"]},
                            "train": {"epochs": 1, "batch_size": 32, "warmup_steps": 1},
                            "amp": {"audit_batches": 1}, "profile": {"steps": 0},
                            "variants": {"amp": {"precision": "fp16"}}})
    return runplan.make_plan(cfg, "amp", "cpu"), data.load_prepared(tmp_path, "cpu")


def test_the_non_finite_diagnosis_replays_a_frozen_model(tiny_data_frozen):
    """A frozen parameter takes no gradient hook: the diagnosis of an fp16 stop watches the trained ones."""
    plan, prepared = tiny_data_frozen
    s = setup.build(plan, prepared["meta"], torch.device("cpu"))
    x, y = torch.randn(8, 3, 32, 32), torch.randint(0, 10, (8,))
    x[0, 0, 0, 0] = float("inf")
    d = numerics.diagnose(s.model, x, y, s.policy.autocast, 8192.0, s.opt)
    assert "not_made" not in d and d["first_bad_module"] == "0.0" and d["first_bad_grad"] in ("4.0.weight",
                                                                                              "4.1.weight", "7.weight")


def test_weights_saved_from_a_wrapper_and_freeze_bn_alone(tmp_path):
    """A state dict saved from DDP (``module.``), torch.compile (``_orig_mod.``) or Lightning (``model.``) loads;
    ``freeze_bn`` works on the layers a factory froze; a model left with nothing to train is refused."""
    torch.manual_seed(0)
    trained = models.build(ModelConfig(arch="small_cnn"), num_classes=10, image_size=32, device="cpu")
    torch.save({f"module.{k}": v for k, v in trained.state_dict().items()}, tmp_path / "ddp.pt")
    model = models.build(ModelConfig(arch="small_cnn", weights=str(tmp_path / "ddp.pt")), num_classes=10,
                         image_size=32, device="cpu")
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), trained.state_dict().values(),
                                                 strict=True))
    with pytest.raises(ConfigError, match=r"has no parameter left to train with model.freeze = \['0', '2', '4', '7'\]"):
        models.check(ModelConfig(arch="small_cnn", freeze=("0", "2", "4", "7")), num_classes=10, image_size=32)
    model = finetune.freeze(models.build(ModelConfig(arch="small_cnn"), num_classes=10, image_size=32,
                                         device="cpu").requires_grad_(False), ModelConfig(freeze_bn=True), 32)
    model.train()(torch.randn(2, 3, 32, 32))
    assert not model[0][1].training  # a frozen BatchNorm of the factory's own, kept in eval mode


def test_an_fp16_run_of_a_frozen_model_writes_its_run_folder(tiny_data_frozen, tmp_path):
    """The run that lost its result to a traceback: fp16's audit over frozen layers, written to disk."""
    plan, prepared = tiny_data_frozen
    result = runner.train(plan, prepared, progress=False)
    out = tmp_path / "run"
    results.write_run(out, result.metrics, result.tables())
    run = results.read_run(out)
    assert run["numerics"] and run["numerics"][0]["frozen"] == "True" and run["numerics"][0]["grad_underflow"] == ""
    m = run["metrics"]
    trained = m["trainable_param_count"]
    assert 0 < trained < m["param_count"]
    assert m["grad_bytes"] == 4 * trained and m["optimizer_state_bytes"] == 4 * trained  # SGD: one momentum each


@pytest.mark.slow
def test_dvc_repro_fine_tunes_torchvision_weights_with_a_frozen_backbone(hub, tmp_path, tmp_mlflow):
    """tv:resnet18 with IMAGENET1K_V1 from torch hub's cache (a local file), its backbone frozen and its batch norms
    fixed, in fp32, fp16 and bf16 through the real pipeline: every frozen parameter byte for byte as loaded, the
    head trained, the memory section's optimizer state that of the head alone, the report naming what trained, and
    the LoggedModel loaded back with no pretrained file to fetch."""
    from ampbench import sandbox
    from tests.conftest import SHRINK
    path, state = hub
    params = sandbox.merge(yaml.safe_load((REPO_ROOT / "params.yaml").read_text()), SHRINK)
    params = sandbox.merge(params, {
        "data": {"train_size": 32, "test_size": 16},
        "model": {"arch": "tv:resnet18", "weights": "IMAGENET1K_V1", "freeze": ["backbone"], "freeze_bn": True},
        "train": {"batch_size": 16, "warmup_steps": 1, "eval_batch_size": 16}, "amp": {"audit_batches": 1},
        "profile": {"steps": 1}, "sweep": {"enabled": False}, "mlflow": {"log_model": True}})
    params["variants"] = {"fp32": {"precision": "fp32"}, "amp": {"precision": "fp16"}, "bf16": {"precision": "bf16"}}
    repo = sandbox.create(tmp_path / "repo", params)
    proc = subprocess.run([sys.executable, "-m", "dvc", "repro"], cwd=repo, env=sandbox.env_with_venv(),
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "its final layer fc made anew for the data's 10 classes" in proc.stdout
    assert "(5,130 of 11,181,642 parameters trained)" in proc.stdout
    assert "could not be made" not in proc.stdout, proc.stdout[-3000:]
    r = repo / "reports"
    for v in params["variants"]:
        saved = torch.load(r / "runs" / v / "model.pt", weights_only=True)["state_dict"]
        assert all(torch.equal(saved[k], t) for k, t in state.items() if not k.startswith("fc.")), v  # BN stats too
        m = json.loads((r / "runs" / v / "metrics.json").read_text())
        assert m["trainable_param_count"] == 5130 and m["optimizer_state_bytes"] == 4 * 5130
        assert m["grad_bytes"] == 4 * 5130
    md = (r / "report.md").read_text()
    assert "Model tv:resnet18 (5,130 of 11,181,642 parameters trained" in md
    assert "fp16 numerics audit of `amp` (" in md and " of them frozen, " in md
    path.unlink()  # the LoggedModel is the trained model: nothing pretrained to fetch
    import mlflow
    from mlflow.tracking import MlflowClient
    client = MlflowClient(tmp_mlflow)
    [run] = [r for r in client.search_runs([client.get_experiment_by_name("ampbench").experiment_id])
             if r.info.run_name == "train@amp"]
    assert run.data.params["model.weights"] == "IMAGENET1K_V1" and run.data.params["model.freeze"] == "('backbone',)"
    (out,) = run.outputs.model_outputs
    mlflow.set_tracking_uri(tmp_mlflow)
    module = mlflow.pytorch.load_model(f"models:/{out.model_id}")
    saved = torch.load(r / "runs" / "amp" / "model.pt", weights_only=True)["state_dict"]
    assert all(torch.equal(module.state_dict()[k], v) for k, v in saved.items())


def test_the_fine_tune_example_is_what_the_readme_points_to():
    text = (REPO_ROOT / "examples" / "finetune.yaml").read_text()
    example = yaml.safe_load(text)
    cfg = config.from_dict(example)
    assert cfg.model.weights == "DEFAULT" and cfg.model.freeze == ("backbone",) and cfg.model.freeze_bn
    assert "examples/finetune.yaml" in (REPO_ROOT / "README.md").read_text()


@pytest.mark.parametrize("rung", ["fp8", "mxfp8"])
def test_fp8_keeps_frozen_linear_layers_out_of_the_conversion_and_says_so(rung):
    """torchao's float8 and MX Linear compute the weight's gradient GEMM whether or not the weight trains: a frozen
    block converted would pay it. vit_tiny with every block frozen but the last: only the last block converts."""
    from ampbench import precision
    r = precision.rung(rung)
    free = models.build_meta(ModelConfig(arch="vit_tiny"), num_classes=10, image_size=16)
    cfg = ModelConfig(arch="vit_tiny", freeze=tuple(f"encoder.layers.encoder_layer_{i}" for i in range(5)))
    tuned = models.build_meta(cfg, num_classes=10, image_size=16)
    all_, last = (r.census(m, r.cpu_recipes[0], 16) for m in (free, tuned))
    assert last["called"] == [n for n in all_["called"] if n.startswith("encoder.layers.encoder_layer_5.")]
    assert last["called"] and all(n.startswith("encoder.layers.encoder_layer_") for n in last["frozen"])
    assert len(last["frozen"]) == all_["converted"] - last["converted"]
    assert "frozen Linear layer(s) it could convert stay bf16" in r.census_summary(last)
    model = precision.rung(rung).prepare(models.build(cfg, num_classes=10, image_size=16, device="cpu"),
                                         r.cpu_recipes[0])
    converted = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)  # a torchao module, or weight
                 and (type(m).__module__.startswith("torchao") or type(m.weight) is not torch.nn.Parameter)}
    assert converted and all(n.startswith("encoder.layers.encoder_layer_5.") for n in converted)
    from ampbench.train import step
    from ampbench.train.policy import PrecisionPolicy
    policy = PrecisionPolicy(rung, "cpu", None, r.cpu_recipes[0])
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    x, y = torch.randn(32, 3, 16, 16), torch.randint(0, 10, (32,))  # 32 x 17 tokens: MX's blocks of 32
    for _ in range(2):  # the second: torchvision's ViT head starts at zero, so the first moves the head alone
        step.train_step(model, opt, policy.scaler(), policy, x, y, 32)
    moved = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert moved == trained  # the converted block's weights and biases too


def _frozen_worker(rank: int, port: int, folder: str) -> None:
    world = _join(rank, port)
    cfg = config.from_dict({"device": "cpu", "model": {"arch": "small_cnn", "freeze": ["0", "2"]},
                            "mlflow": {"enabled": False}, "train": {"epochs": 1, "batch_size": 32, "warmup_steps": 0},
                            "distributed": {"nproc_per_node": WORLD}})  # find_unused_parameters: false
    trainer = Trainer(runplan.make_plan(cfg, "fp32", "cpu"), data.load_prepared(Path(folder) / "prepared", "cpu"),
                      progress=False, world=world)
    start = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    batches = trainer.train_batches.epoch(0)
    for i in range(3):
        trainer.step_in_epoch = trainer.global_step = i
        trainer.optimizer_step(*next(batches))
    end = dict(trainer.model.named_parameters())
    out = {"frozen_same": all(torch.equal(end[n], start[n]) for n in start if n.startswith(("0.", "2."))),
           "moved": sorted(n for n in start if not torch.equal(end[n], start[n])),
           "unused_flag": trainer.step_model.find_unused_parameters,
           "weights": [float(p.detach().double().sum()) for p in end.values()]}
    (Path(folder) / f"rank{rank}.json").write_text(json.dumps(out))
    distributed.shutdown()


def test_ddp_trains_a_frozen_backbone_without_find_unused_parameters(tmp_path):
    """Frozen parameters are not DDP's: it all-reduces the trained ones alone and waits for no gradient of a frozen
    one, so a fine-tuned model trains on 2 ranks with find_unused_parameters off, the frozen blocks unchanged."""
    ranks = _ranks(tmp_path, _frozen_worker)
    assert ranks[0] == ranks[1]
    r = ranks[0]
    assert r["frozen_same"] and r["unused_flag"] is False
    assert r["moved"] == ["4.0.weight", "4.1.bias", "4.1.weight", "7.bias", "7.weight"]
