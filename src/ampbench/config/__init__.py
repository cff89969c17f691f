"""params.yaml into frozen dataclasses: the only reader of params.yaml.

Every field has a default and a comment. Unknown keys and bad values raise
``ConfigError`` with one line naming the key, the bad value and what is
allowed. Integers are accepted where floats are expected.

A package: ``schema`` (the dataclasses and their rules), ``validate`` (building, cross-checks, migration,
``load``), ``uri`` (the MLflow tracking URI). Everything is importable from ``ampbench.config`` itself.
"""

from ampbench.config import optim  # noqa: F401  the optimizer registry
from ampbench.config.schema import (  # noqa: F401  # noqa: F401  the underscored names the other modules use
    ARCH_NAMES,
    BAD_FILES,
    DATA_SOURCES,
    GRAD_COMMS,
    OPTIMIZER_IMPLS,
    PLACEMENTS,
    AmpConfig,
    Config,
    DataConfig,
    DebugConfig,
    DistributedConfig,
    MlflowConfig,
    ModelConfig,
    PairedConfig,
    ProfileConfig,
    SweepConfig,
    TrainConfig,
    Variant,
    _default_variants,
    _opt,
    flatten,
    resolve_backend,
    resolve_workers,
    sweep_precisions,
    to_dict,
    variant_world,
)
from ampbench.config.uri import one_line, project_root, redact, redact_text, tracking_uri  # noqa: F401
from ampbench.config.validate import from_dict, load, micro_batch, path_is  # noqa: F401
from ampbench.errors import ConfigError  # noqa: F401  what every refusal raises
