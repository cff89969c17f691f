"""The schema of a run's metrics.json and of env.json: one ``TypedDict`` each, which the writers build and the
report reads (``summary.COPIED`` names keys of ``Metrics``; a test holds the writers to it).

A value that was not measured is ``None`` (null in the file), never a made-up number.
"""

from __future__ import annotations

from typing import TypedDict


class StepTimes(TypedDict):
    median: float
    p10: float
    p90: float
    n: int


class Metrics(TypedDict, total=False):
    """One train stage's metrics.json (``train.metrics.run_result``, completed by the runner and the stage)."""
    # what ran
    variant: str
    precision: str
    accum_steps: int
    micro_batch_size: int
    epochs: int
    batch_size: int
    arch: str
    model: str
    param_count: int
    trainable_param_count: int  # those with requires_grad (fine-tuning freezes the rest)
    input_size: int
    num_classes: int
    device: str
    device_name: str
    world_size: int
    backend: str | None
    cpu_threads: int
    grad_comm: str | None
    strategy: str | None   # data parallelism: ddp | fsdp (None in one process)
    fsdp: dict             # FSDP only: the blocks, dtypes, bytes per step and memory per rank (train/fsdp.describe)
    compiled: bool
    augment: bool
    torch: str
    tf32: dict
    optimizer: str
    optimizer_impl: str
    optimizer_state_kept: str
    clip_grad_norm: float | None
    grad_norm_logged: bool
    fp8_recipe: str | None
    fp8_layers: dict | None
    data_source: str
    data_placement: str
    data_workers: int | None
    train_images: int
    test_images: int
    train_images_per_epoch: int
    dataset: dict
    # speed
    imgs_per_s: float | None
    imgs_per_s_p10_p90: list[float] | None
    compute_imgs_per_s: float | None
    imgs_per_s_per_process: float | None
    step_time_ms: StepTimes | None
    compute_time_ms: StepTimes | None
    data_time_ms: StepTimes | None
    data_time_fraction: float | None
    timed_steps: int
    warmup_steps: int
    epoch_time_s: float | None
    timing_note: str
    train_flops_per_image: float | None
    achieved_tflops: float | None
    peak_tflops_datasheet: float | None
    peak_precision: str
    fraction_of_peak: float | None
    # memory
    peak_mem_bytes: int
    peak_reserved_bytes: int | None
    mem_meter: str
    peak_window: str
    eval_peak_mem_bytes: int | None
    first_step_peak_mem_bytes: int | None
    activation_bytes: int | None
    param_bytes: int
    grad_bytes: int
    optimizer_state_bytes: int
    dataset_bytes: int
    # accuracy and numerics
    final_acc: float | None
    best_acc: float
    final_loss: float | None
    final_eval_loss: float | None
    final_loss_scale: float | None
    skipped_steps: int
    nonfinite_loss_steps: int
    optimizer_steps: int
    accum_grad_max_rel_diff: float | None
    status: str
    diagnosis: dict
    # repeats (train.repeats): each repeated figure's mean, its spread and its values
    repeats: int
    seeds: list[int]
    imgs_per_s_std: float | None
    imgs_per_s_runs: list[float]
    compute_imgs_per_s_std: float | None
    compute_imgs_per_s_runs: list[float]
    final_acc_std: float | None
    final_acc_runs: list[float]
    best_acc_std: float | None
    best_acc_runs: list[float]
    final_loss_std: float | None
    final_loss_runs: list[float]
    achieved_tflops_std: float | None
    achieved_tflops_runs: list[float]
    epoch_time_s_std: float | None
    epoch_time_s_runs: list[float]
    # analyses around training, and the stage's record
    profile: dict
    not_made: dict[str, str]
    gpu_sm_clock_mhz_median: float | None
    gpu_sm_clock_mhz_p10_p90: list[float] | None  # while the GPU was busy (utilisation >= 50%)
    gpu_temperature_c_median: float | None
    gpu_power_w_median: float | None
    energy_per_image_j: float | None
    started_at: str
    finished_at: str
    command: str
    git_commit: str
    env_fingerprint: str


class Gpu(TypedDict):
    name: str
    count: int
    capability: str            # "9.0"
    total_memory_bytes: int
    multiprocessors: int
    driver: str | None
    tensor_cores: bool
    fp16_tensor_cores: bool
    arch_list: list[str]       # the architectures this torch build carries kernels for
    kernels: bool
    bf16_supported: bool
    tf32_capable: bool
    fp8_supported: bool


class Env(TypedDict, total=False):
    """env.json (``env.machine.probe``): deterministic, so it changes only when the machine did."""
    torch: str
    python: str
    platform: str
    cpu_model: str
    cpu_count: int | None
    torch_threads: int
    cuda_available: bool
    cuda_runtime: str | None
    cudnn: int | None
    tf32_defaults: dict
    gpu: Gpu | None
    driver: str | None
    nccl: list[int] | int | None
