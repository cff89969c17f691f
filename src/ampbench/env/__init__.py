"""The machine and what runs beside training: a package of three concerns, all importable from ``ampbench.env``.

- ``machine``: ``probe()`` (the hardware and software, deterministic: ``reports/env.json`` changes only when the
  machine did) and the refusals (driver against wheel, arch list, capability, DDP's backend): ``resolve_device``.
- ``placement``: where the data set lives (device or streamed), the device's memory, cores, shared memory.
- ``services``: the DVC experiment queue's workers, the MLflow tracking store's reachability.
"""

from ampbench.env import machine, placement, services  # noqa: F401
from ampbench.env.machine import (  # noqa: F401
    MIN_DRIVER_FOR_CUDA,
    OLDER_TORCH,
    PROBE_OVERRIDE_ENV,
    check_distributed,
    has_kernels,
    has_tensor_cores,
    min_driver,
    probe,
    resolve_device,
    warnings_for,
)
from ampbench.env.placement import (  # noqa: F401
    DATA_SHARE,
    MEMORY_CAP_ENV,
    SHM,
    check_fits,
    check_shared_memory,
    choose_placement,
    device_memory,
    usable_cores,
)
from ampbench.env.services import (  # noqa: F401
    DATABASES,
    check_queue,
    check_tracking_server,
    queue_workers,
)
