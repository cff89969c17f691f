"""ampbench: what FP16 mixed precision really buys on your hardware.

The library behind the DVC stages in ``stages/``: configuration, the
environment probe, data, models, the precision policy, the one training loop,
measurement, MLflow tracking and the report.
"""

__version__ = "0.1.0"
