"""A training run's model as an MLflow LoggedModel: rebuilt from its weights file with the code that loads it."""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

from mlflow.tracking import MlflowClient


def _log_model(client: MlflowClient, uri: str, exp_id: str, rid: str, run_name: str, path: Path,
               tags: dict) -> str | None:
    """The run's trained model as an MLflow LoggedModel, rebuilt from its weights file (``results.MODEL``) with the
    code that loads it (ampbench's package; a user factory's package) and explicit pip requirements (inferring
    them imports the model's modules and asks a package index); its id. Raises when it cannot be logged (a LoggedModel
    already created is marked FAILED): the caller runs it as an analysis."""
    import mlflow
    import torch
    import torchvision

    from ampbench import models
    saved = torch.load(path, map_location="cpu", weights_only=True)
    variant = run_name.split("@")[-1]
    # a factory that no longer builds what it trained raises here: the run is logged without the model
    module = _built(saved)
    code = [Path(models.__file__).resolve().parents[1]]  # the ampbench package: built-in models unpickle from it
    factory = saved["model"].get("factory")
    if factory:
        top = Path.cwd() / factory.split(":")[0].split(".")[0]
        code.append(top if top.is_dir() else top.with_suffix(".py"))
    lm = client.create_logged_model(exp_id, name=variant, source_run_id=rid, model_type="image-classifier",
                                    params={"precision": saved.get("precision", ""), "num_classes":
                                            str(saved["num_classes"]), "image_size": str(saved["image_size"]),
                                            **{f"model.{k}": str(v) for k, v in saved["model"].items()}},
                                    tags={k: v for k, v in tags.items() if k.startswith("ampbench.")})
    mlflow.set_tracking_uri(uri)
    requirements = [f"{m.__name__}=={m.__version__.split('+')[0]}" for m in (torch, torchvision)]
    quiet = logging.getLogger("mlflow.pytorch")
    level, quiet.level = quiet.level, logging.ERROR  # its note on pickle: these are the user's own weights and code
    try:
        with _pins_taken_as_read():
            mlflow.pytorch.log_model(module, name=variant, model_id=lm.model_id, serialization_format="pickle",
                                     code_paths=[str(p) for p in code if p.exists()], pip_requirements=requirements)
        client.log_model_artifact(lm.model_id, str(path))  # the weights alone, for `load_weights` (no pickle)
    except Exception:
        client.finalize_logged_model(lm.model_id, "FAILED")
        raise
    finally:
        quiet.level = level
    return lm.model_id


def _built(saved: dict):
    """The architecture a weights file was trained in (built from its own record), with those weights."""
    from ampbench import models
    from ampbench.config import ModelConfig
    module = models.build(ModelConfig(**{**saved["model"], "freeze": tuple(saved["model"].get("freeze", ()))}),
                          num_classes=saved["num_classes"], image_size=saved["image_size"], device="cpu",
                          pretrained=False)  # its own trained weights, not the pretrained ones fetched again
    module.load_state_dict(saved["state_dict"])
    return module


MAX_CLASSES, MAX_IMAGE = 1_000_000, 4096  # a weights file that asks for more is not one ampbench wrote


def load_weights(model_id: str, tracking_uri: str | None = None, factory: str = ""):
    """A LoggedModel's trained model without unpickling anything from the store: its weights file (tensors and
    plain values, read with ``torch.load(weights_only=True)``) loaded into the architecture built by this
    machine's code (ampbench's models; a ``model.factory`` runs the factory in the current folder). The safe way
    for a model from a server others can write to: ``mlflow.pytorch.load_model`` unpickles the model, which runs
    whatever code the pickle names. The file names its architecture: a built-in one (``resnet18``, ``tv:...``) is
    built here; one built by a ``model.factory`` is refused unless the caller names that same factory
    (``factory=``), so a file written by someone else cannot choose which of your modules is imported and run."""
    import tempfile

    import mlflow
    import torch
    from mlflow.tracking import MlflowClient

    from ampbench import results
    location = MlflowClient(tracking_uri).get_logged_model(model_id).artifact_location
    with tempfile.TemporaryDirectory() as tmp:
        path = mlflow.artifacts.download_artifacts(artifact_uri=f"{location.rstrip('/')}/{results.MODEL}",
                                                   dst_path=tmp, tracking_uri=tracking_uri)
        saved = torch.load(path, map_location="cpu", weights_only=True)
    return _built(trusted(saved, model_id, factory))


def trusted(saved: dict, model_id: str, factory: str = "") -> dict:
    """``saved`` (a weights file's record) if building what it names runs no code the caller did not name, and
    asks for no more than ampbench writes; else a one-line refusal."""
    from ampbench.errors import ConfigError
    named = (saved.get("model") or {}).get("factory") or ""
    if named and named != factory:
        raise ConfigError(f"LoggedModel {model_id} was built by the factory {named!r}, code in your folder that "
                          f"loading it would import and run: if you trust that, pass factory={named!r}")
    if not (0 < int(saved.get("num_classes", 0)) <= MAX_CLASSES and 0 < int(saved.get("image_size", 0)) <= MAX_IMAGE):
        raise ConfigError(f"LoggedModel {model_id}: its weights file asks for {saved.get('num_classes')} classes at "
                          f"{saved.get('image_size')} px, not what ampbench writes; not loaded")
    return saved


@contextlib.contextmanager
def _pins_taken_as_read():
    """MLflow checks a model's pip requirements against the installed packages, and maps every installed
    distribution's modules to do it, once in each process (0.6 s of a train stage in this project's venv, more in
    a larger environment). Ours are read from the modules running (``torch.__version__``), so that check can only
    agree: it is skipped while our model is saved. Where MLflow has moved it, nothing is skipped."""
    from mlflow.utils import environment
    check = getattr(environment, "warn_dependency_requirement_mismatches", None)
    if check is None:
        yield
        return
    environment.warn_dependency_requirement_mismatches = lambda requirements: None
    try:
        yield
    finally:
        environment.warn_dependency_requirement_mismatches = check
