"""Models by name: vit_tiny, torchvision's classifiers, a user's factory; each trains in every precision."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch
import yaml

from ampbench import config, data, models, runplan
from ampbench.config import AmpConfig, ModelConfig
from ampbench.errors import ConfigError
from ampbench.sandbox import REPO_ROOT
from ampbench.train import numerics, runner, step
from ampbench.train.policy import PrecisionPolicy


def test_builtin_names_match_the_config():
    assert tuple(models.ARCHS) == config.ARCH_NAMES


@pytest.mark.parametrize("arch", ["vit_tiny", "tv:mobilenet_v3_small"])
@pytest.mark.parametrize("precision", ["fp32", "fp16", "bf16"])
def test_one_step_per_precision(arch, precision):
    torch.manual_seed(0)
    model = models.build(ModelConfig(arch=arch), num_classes=7, image_size=32, device="cpu")
    policy = PrecisionPolicy(precision, "cpu", AmpConfig() if precision == "fp16" else None)
    scaler = policy.scaler()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    x = torch.randn(16, 3, 32, 32).contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, 7, (16,))
    loss = step.accumulate_gradients(model, x, y, 8, policy, scaler)  # two micro-batches
    scaler.step(opt)
    scaler.update()
    assert torch.isfinite(loss)
    assert scaler.get_scale() == (8192.0 if precision == "fp16" else 1.0)  # not skipped
    assert model(x).shape == (16, 7)  # the head has num_classes outputs
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_vit_tiny_is_torchvisions_vision_transformer():
    from torchvision.models.vision_transformer import VisionTransformer
    m = models.vit_tiny(10, 32)
    assert isinstance(m, VisionTransformer) and m.patch_size == 4 and m.hidden_dim == 192
    assert len(m.encoder.layers) == 6 and m.encoder.layers[0].num_heads == 3


def test_audit_sees_vit_softmax_attention_and_layernorm():
    torch.manual_seed(0)
    model = models.build(ModelConfig(arch="vit_tiny", channels_last=False), num_classes=10, image_size=32,
                         device="cpu")
    x, y = torch.randn(4, 3, 32, 32), torch.randint(0, 10, (4,))
    rows = {r["layer"]: r for r in numerics.audit(model, [(x, y)], 8192.0, "cpu")}
    attn = rows["encoder.layers.encoder_layer_0.self_attention"]
    ln = rows["encoder.layers.encoder_layer_0.ln_1"]
    assert attn["type"] == "MultiheadAttention" and attn["autocast_dtype"] == "float16"
    assert ln["type"] == "LayerNorm" and ln["autocast_dtype"] == "float32"  # autocast keeps LayerNorm in fp32
    assert 0 <= attn["grad_underflow"] <= 1 and "act_overflow" in ln


def test_unknown_torchvision_name_lists_valid_ones():
    with pytest.raises(ConfigError, match="no classification model 'resnet5000'.*resnet50"):
        models.check(ModelConfig(arch="tv:resnet5000"), num_classes=10, image_size=32)


def test_input_too_small_for_the_model_is_one_line_with_the_fix():
    with pytest.raises(ConfigError) as err:
        models.check(ModelConfig(arch="tv:vit_b_16"), num_classes=10, image_size=32)
    assert str(err.value) == ("params.yaml: model 'tv:vit_b_16' needs 224x224 inputs (the data's 32): set "
                              "model.input_size: 224")
    assert models.check(ModelConfig(arch="tv:vit_b_16"), num_classes=10, image_size=224)["param_count"] > 85e6


def test_vit_tiny_needs_a_multiple_of_its_patch():
    with pytest.raises(ConfigError, match="divisible by its patch"):
        models.check(ModelConfig(arch="vit_tiny", input_size=30), num_classes=10, image_size=30)


# --- the user's own factory -------------------------------------------------------------------

GOOD = """
from torch import nn

def build(num_classes):
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(8, num_classes))

def sized(num_classes, image_size):
    return nn.Sequential(nn.Flatten(), nn.Linear(3 * image_size * image_size, num_classes))

def broken(num_classes):
    raise ValueError("no such width")

def not_a_module(num_classes):
    return "a string"

class Spare(nn.Module):  # a second head the loss never uses
    def __init__(self, num_classes):
        super().__init__()
        self.body, self.head, self.spare = nn.Flatten(), nn.Linear(3 * 32 * 32, num_classes), nn.Linear(4, 4)

    def forward(self, x):
        return self.head(self.body(x))

def spare(num_classes):
    return Spare(num_classes)

def frozen(num_classes):
    return build(num_classes).requires_grad_(False)
"""


@pytest.fixture
def user_models(tmp_path, monkeypatch):
    (tmp_path / "mymodels").mkdir()
    (tmp_path / "mymodels" / "__init__.py").write_text("")
    (tmp_path / "mymodels" / "nets.py").write_text(textwrap.dedent(GOOD))
    (tmp_path / "mymodels" / "typo.py").write_text("import torchh\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    yield tmp_path
    for name in [n for n in sys.modules if n.startswith("mymodels")]:
        del sys.modules[name]


def test_factory_builds_the_users_module(user_models):
    info = models.check(ModelConfig(factory="mymodels.nets:build"), num_classes=5, image_size=32)
    assert info == {"model": "mymodels.nets:build", "param_count": 3 * 8 * 9 + 8 + 8 * 5 + 5, "unused": [],
                    "trainable_param_count": 3 * 8 * 9 + 8 + 8 * 5 + 5,
                    "param_shapes": [(8, 3, 3, 3), (8,), (5, 8), (5,)], "frozen_shapes": [],
                    "fsdp_blocks": ["0", "4"]}  # a user's factory: its top-level parts with parameters
    sized = models.build(ModelConfig(factory="mymodels.nets:sized", channels_last=False), num_classes=3,
                         image_size=16, device="cpu")
    assert sized[1].in_features == 3 * 16 * 16  # image_size is passed when the factory takes it


def test_parameters_the_loss_does_not_use_are_found_and_ddp_without_its_flag_refused(user_models):
    from ampbench.config import DistributedConfig
    info = models.check(ModelConfig(factory="mymodels.nets:spare"), num_classes=5, image_size=32)
    assert info["unused"] == ["spare.weight", "spare.bias"]
    cfg = ModelConfig(factory="mymodels.nets:spare")
    with pytest.raises(ConfigError) as err:
        models.check_unused(info, cfg, DistributedConfig(nproc_per_node=2), ddp=True)
    for words in ("2 parameter(s)", "spare.weight, spare.bias", "nproc_per_node = 2",
                  "distributed.find_unused_parameters: true"):
        assert words in str(err.value)
    models.check_unused(info, cfg, DistributedConfig(nproc_per_node=2, find_unused_parameters=True), ddp=True)
    models.check_unused(info, cfg, DistributedConfig(nproc_per_node=1), ddp=True)  # one process: no DDP
    models.check_unused(info, cfg, DistributedConfig(nproc_per_node=2), ddp=False)  # every variant ddp: false
    # nothing trainable: nothing to train (an optimizer over no parameter), said before any stage runs
    with pytest.raises(ConfigError, match=r"model 'mymodels.nets:frozen' has no parameter left to train \(its factory "
                                          r"froze them all\); leave at least the final classification layer"):
        models.check(ModelConfig(factory="mymodels.nets:frozen"), num_classes=5, image_size=32)


@pytest.mark.parametrize(("factory", "words"), [
    ("mymodels.typo:build", "importing mymodels.typo failed (ModuleNotFoundError: No module named 'torchh')"),
    ("mymodels.absent:build", "importing mymodels.absent failed"),
    ("mymodels.nets:nothing", "has no function 'nothing'"),
    ("mymodels.nets:broken", "raised ValueError: no such width"),
    ("mymodels.nets:not_a_module", "returned a str, not a torch.nn.Module"),
])
def test_bad_factories_are_one_line(user_models, factory, words):
    with pytest.raises(ConfigError) as err:
        models.check(ModelConfig(factory=factory), num_classes=5, image_size=32)
    assert words in str(err.value) and "\n" not in str(err.value)


def test_factory_source_hash_follows_its_package(user_models):
    cfg = ModelConfig(factory="mymodels.nets:build")
    first = models.source_hash(cfg)
    assert first and models.source_hash(cfg) == first
    (user_models / "mymodels" / "helpers.py").write_text("WIDTH = 8\n")  # a sibling module counts too
    assert models.source_hash(cfg) != first
    assert models.source_hash(ModelConfig()) == ""


def test_env_check_stage_refuses_a_broken_factory(user_models, tiny_params):
    tiny_params["model"]["factory"] = "mymodels.nets:not_a_module"
    (user_models / "params.yaml").write_text(yaml.safe_dump(tiny_params))
    proc = subprocess.run([sys.executable, str(REPO_ROOT / "stages" / "env_check.py"), "--params", "params.yaml",
                           "--env", "reports/env.json", "--plans", "reports/plans", "--data-source",
                           "reports/data_source.json", "--model-source", "reports/model_source.json",
                           "--roofline", "reports/roofline.json"],
                          cwd=user_models, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == ["error: params.yaml: model.factory = 'mymodels.nets:not_a_module' "
                                                "returned a str, not a torch.nn.Module; return the model itself"]
    assert not (user_models / "reports" / "env.json").exists()


def test_training_a_torchvision_model_at_a_larger_input(tmp_path, tiny_params):
    """Everything downstream works for a tv: model fed resized images: metrics name it and count its parameters."""
    tiny_params["model"] = {"arch": "tv:resnet18", "input_size": 40}
    # one emulated fp16 step of 8 images (a batch of 32 at 40 px is 20 s on an Intel Xeon), one evaluation batch
    tiny_params["data"].update(train_size=8, test_size=8)
    tiny_params["train"]["batch_size"] = 8
    tiny_params["amp"]["audit_batches"] = 1
    tiny_params["profile"] = {"steps": 0}  # the step profile: test_profile; a tv: model through dvc repro: test_zoo
    cfg = config.from_dict(tiny_params)
    data.prepare(cfg.data, 0, tmp_path / "p", tmp_path / "raw")
    prepared = data.load_prepared(tmp_path / "p", "cpu")
    result = runner.train(runplan.make_plan(cfg, "amp", "cpu"), prepared, progress=False)
    m = result.metrics
    assert m["model"] == "tv:resnet18" and m["input_size"] == 40 and m["num_classes"] == 10
    assert m["param_count"] == sum(p.numel() for p in models.build(cfg.model, num_classes=10, image_size=40,
                                                                     device="cpu").parameters())
    assert m["activation_bytes"] > 0 and m["train_flops_per_image"] > 0
    assert json.dumps(m)  # serialisable as metrics.json
    assert result.numerics and {r["layer"] for r in result.numerics} >= {"conv1", "fc"}
