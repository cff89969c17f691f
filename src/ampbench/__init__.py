"""ampbench: what FP16 mixed precision really buys on your hardware.

The library behind the DVC stages in ``stages/``: configuration, the
environment probe, data, models, the precision policy, the one training loop,
measurement, MLflow tracking and the report.
"""

__version__ = "0.1.0"


def _quiet_known_noise() -> None:
    """torchao 0.18 under torch 2.14 logs, at its import, that registering an Enum as a pytree constant is
    deprecated ("<enum 'KernelPreference'> is an Enum subclass ..."): a note for torchao's authors, printed on every
    stage that converts a model. That one message is dropped; torch's other warnings are kept."""
    import logging

    class KnownNoise(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            return "is an Enum subclass and is now natively supported" not in record.getMessage()

    logging.getLogger("torch.utils._pytree").addFilter(KnownNoise())


_quiet_known_noise()
