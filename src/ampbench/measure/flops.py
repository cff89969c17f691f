"""Model FLOPs per image (torch.utils.flop_counter), and the one table of what each GPU could give at most.

``DATASHEET``: per GPU, NVIDIA's datasheet figures for dense math (no sparsity: the datasheets' starred
figures are halved), in TFLOP/s: plain FP32 (no tensor cores), TF32, FP16/BF16 and FP8 tensor cores, each with
FP32 accumulation (GeForce cards run FP16 and FP8 with FP32 accumulation at half their FP16-accumulation rate;
these rows hold the FP32-accumulation rate, which is what torch's autocast uses), and memory bandwidth in GB/s
(the roofline's other axis). None: the GPU has no such tensor core. The figures are quoted, not measured, and the
report labels them so. A MIG slice matches no row: its share of the GPU's peak is not its share of the name.
"""

from __future__ import annotations

import copy
import re

import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from ampbench import precision

# the rungs' datasheet columns (each rung names its own), and the memory bandwidth
COLUMNS = (*dict.fromkeys(r.datasheet for r in precision.RUNGS.values()), "bandwidth_gbps")


def _row(name: str, source: str, bandwidth_gbps: float, *, bf16_as_fp16: bool = True, **peaks) -> dict:
    """One GPU's row: dense peaks by datasheet column (TFLOP/s; None: no such tensor core) and its bandwidth.
    bf16 runs at fp16's rate on every GPU that has it (``bf16_as_fp16``); a column not given is None."""
    unknown = set(peaks) - set(COLUMNS)
    assert not unknown, f"{name}: no such datasheet column {unknown}"
    if bf16_as_fp16:
        peaks["bf16"] = peaks["fp16"]
    return {"name": name, "source": source, **dict.fromkeys(COLUMNS[:-1]), **peaks, "bandwidth_gbps": bandwidth_gbps}


_HOPPER = "NVIDIA H100 Tensor Core GPU datasheet"
_H200 = "NVIDIA H200 Tensor Core GPU datasheet"
_A100 = "NVIDIA A100 Tensor Core GPU datasheet (80GB SXM: 2,039 GB/s; 40GB: 1,555 GB/s)"
_BLACKWELL = "NVIDIA RTX Blackwell GPU architecture whitepaper (FP32-accumulate tensor rates)"
_ADA = "NVIDIA Ada GPU architecture whitepaper (FP32-accumulate tensor rates)"
_AMPERE = "NVIDIA Ampere GA102 GPU architecture whitepaper (FP32-accumulate tensor rates)"
_GH200 = ("NVIDIA GH200 Grace Hopper Superchip datasheet, dense rates (67 TF FP32, 494 TF TF32, 990 TF FP16/BF16, "
          "1,979 TF FP8; 96GB HBM3 up to 4 TB/s, 144GB HBM3e up to 4.9 TB/s), as transcribed at https://github.com/"
          "atineoSE/coding-model-seeks-gpu/blob/main/pipeline/pipeline/sources/gh200_specs.md")

# name pattern (first match wins: the specific before the general) -> name, cited source, GB/s, dense TFLOP/s.
# A pattern matches the card it names and no other: not its laptop part (a third of the compute, 576 to 896 GB/s),
# not a China-market "D" part, not a Grace Hopper superchip's GPU for an H100 or H200 row (``_NOT_THE_PART``: such
# a part matches only a row of its own). A figure the cited page does not print is marked "derived" in the source.
DATASHEET = [
    (r"\bB200\b", _row("B200", "NVIDIA HGX B200 datasheet, per GPU (600 TF FP32, 18 PF TF32*, 36 PF FP16*, "
                        "72 PF FP8* for 8; MXFP8 at the FP8 rate); memory 7.7 TB/s per GPU (180 GB HBM3e), the HGX "
                        "B200 column of NVIDIA's GB200 NVL72 / HGX B200 table, as reproduced at https://zdszero.github."
                        "io/Computer/Artificial_Intelligence/Hardware.html (8 TB/s is GB200's; DGX B200 pages give 64 "
                        "TB/s for 8)", 7700, fp32=75.0, tf32=1125.0, fp16=2250.0,
                        fp8=4500.0, mxfp8=4500.0)),
    # Grace Hopper's GPU: the H100's tensor rates, its own memory (96GB HBM3, sold as "GH200 480GB"; 144GB HBM3e)
    (r"\bGH200\b.*(144G|HBM3e)", _row("GH200 144GB HBM3e", _GH200, 4900, fp32=67.0, tf32=494.0, fp16=990.0,
                                          fp8=1979.0)),
    (r"\bGH200\b.*(480GB|96G)", _row("GH200 96GB HBM3", _GH200, 4000, fp32=67.0, tf32=494.0, fp16=990.0, fp8=1979.0)),
    (r"\bH200 NVL\b", _row("H200 NVL", _H200, 4800, fp32=60.0, tf32=417.5, fp16=835.5, fp8=1670.5)),
    (r"\bH200\b", _row("H200", _H200 + " (SXM)", 4800, fp32=67.0, tf32=494.7, fp16=989.4, fp8=1978.9)),
    (r"\bH100 NVL\b", _row("H100 NVL", _HOPPER, 3900, fp32=60.0, tf32=417.5, fp16=835.5, fp8=1670.5)),
    (r"\bH100\b.*(SXM|HBM3)", _row("H100 SXM", _HOPPER + " (SXM5)", 3350, fp32=67.0, tf32=494.7, fp16=989.4,
                                    fp8=1978.9)),
    (r"\bH100\b", _row("H100 PCIe", _HOPPER + " (PCIe)", 2000, fp32=51.2, tf32=378.0, fp16=756.0, fp8=1513.0)),
    (r"A100 80GB PCIe", _row("A100 80GB PCIe", _A100, 1935, fp32=19.5, tf32=156.0, fp16=312.0, fp8=None)),
    (r"A100.*80GB", _row("A100 80GB SXM", _A100, 2039, fp32=19.5, tf32=156.0, fp16=312.0, fp8=None)),
    (r"A100", _row("A100 40GB", _A100, 1555, fp32=19.5, tf32=156.0, fp16=312.0, fp8=None)),
    (r"L40S", _row("L40S", "NVIDIA L40S datasheet", 864, fp32=91.6, tf32=183.0, fp16=362.05, fp8=733.0)),
    (r"\bL4\b", _row("L4", "NVIDIA L4 Tensor Core GPU datasheet", 300, fp32=30.3, tf32=60.0, fp16=121.0, fp8=242.5)),
    (r"\bA40\b", _row("A40", "NVIDIA A40 datasheet", 696, fp32=37.4, tf32=74.8, fp16=149.7, fp8=None)),
    (r"\bA10\b", _row("A10", "NVIDIA A10 datasheet", 600, fp32=31.2, tf32=62.5, fp16=125.0, fp8=None)),
    # mixed-precision FP16 tensor cores, no TF32 or BF16
    (r"\bV100S\b", _row("V100S PCIe", "NVIDIA V100 datasheet's V100S PCIe column (16.4 TF FP32, 130 TF tensor, "
                         "1,134 GB/s), as reproduced at https://github.com/cx2a/Guts/blob/main/01_warmup/README.md",
                         1134, fp32=16.4, tf32=None, fp16=130.0, fp8=None, bf16_as_fp16=False)),
    (r"\bV100\b.*SXM", _row("V100", "NVIDIA V100 Tensor Core GPU datasheet (SXM2)", 900, fp32=15.7, tf32=None,
                             fp16=125.0, fp8=None, bf16_as_fp16=False)),
    (r"\bV100\b.*PCIE", _row("V100 PCIe", "NVIDIA Tesla V100 PCIe product brief PB-08744-001 (1370 MHz boost: 14 TF "
                              "FP32, 112 TF tensor), as quoted by https://www.io-tech.fi/uutinen/nvidia-esitteli-"
                              "tesla-v100-pci-express-kiihdyttimen-tieteelliseen-laskentaan/", 900, fp32=14.0,
                              tf32=None, fp16=112.0, fp8=None, bf16_as_fp16=False)),
    (r"\bT4\b", _row("T4", "NVIDIA T4 datasheet", 320, fp32=8.1, tf32=None, fp16=65.0, fp8=None,
                     bf16_as_fp16=False)),
    (r"RTX 6000 Ada", _row("RTX 6000 Ada", "NVIDIA RTX 6000 Ada datasheet (91.1 TF FP32, 960 GB/s, FP8 1,457 TF with "
                            "sparsity: 728.5 dense), as transcribed at https://github.com/atineoSE/coding-model-seeks-"
                            "gpu/blob/main/pipeline/pipeline/sources/rtx6000ada_specs.md; FP16/BF16 and TF32 derived, "
                            "not quoted: a half and a quarter of FP8, about as on the L40S datasheet (the same "
                            "AD102: 362.05 FP16, 733 FP8)", 960,
                            fp32=91.1, tf32=182.1, fp16=364.25, fp8=728.5)),
    (r"RTX A6000$", _row("RTX A6000", "38.7 TF FP32 and 768 GB/s (https://servethehome.com/nvidia-rtx-a6000-48gb-gpu-"
                         "drops-quadro-designation); 154.8 TF FP16/BF16 with FP32 accumulation, dense (https://llmperf."
                         "net/categories/gpu/Nvidia-A6000-GPUs, from the GA102 whitepaper); TF32 derived, not quoted: "
                         "half that, as on the A40's datasheet (the same GA102: 74.8 and 149.7)", 768, fp32=38.7,
                         tf32=77.4, fp16=154.8, fp8=None)),
    (r"RTX 4090 Laptop", _row("RTX 4090 Laptop", "the 150 W part at its 2,040 MHz boost, the most NVIDIA's laptops "
                              "run it at (80 to 150 W, boost 1,455 to 2,040 MHz: https://nvidia.com/de-de/geforce/"
                              "gaming-laptops/compare): 39.69 TF FP32 (https://hmc-tech.com/gpu/nvidia-geforce-rtx-"
                              "4090-laptop-150w-vs-nvidia-geforce-rtx-5090-laptop-140w); TF32, FP16 and FP8 with FP32 "
                              "accumulation derived, not quoted: 1x, 2x and 4x FP32, as that site gives them at 140 W "
                              "(37.94, 75.88, 151.76 TF); 576 GB/s. A laptop set lower runs further below this row",
                              576, fp32=39.69, tf32=39.69, fp16=79.38, fp8=158.76)),
    (r"RTX PRO 6000 Blackwell Workstation Edition$", _row(
        "RTX PRO 6000 Blackwell", "the Workstation Edition (600 W) at its 2,617 MHz boost: 125.95 TF FP32, 251.9 TF "
        "TF32, 503.8 TF FP16/BF16 and 1.01 PF FP8 (1,007.6, twice FP16) with FP32 accumulation, dense (https://hmc-"
        "tech.com/gpu/nvidia-rtx-pro-6000-blackwell-vs-amd-radeon-pro-duo-polaris; they match NVIDIA's 125 TF FP32 "
        "and 4,000 sparse FP4 TOPS: 8x 503.8); 1,792 GB/s (https://gpu.name/posts/nvidia-unveils-rtx-pro-6000-"
        "blackwell-gpu-with-24-064-cores-and-96gb-memory). Its Max-Q and Server editions run other clocks: no row",
        1792, fp32=125.95, tf32=251.9, fp16=503.8, fp8=1007.6)),
    (r"RTX 5090$", _row("RTX 5090", _BLACKWELL + "; its fp8 peak (419 TFLOP/s with FP32 accumulation) is the "
                        "whitepaper's alone: no measurement here backs it", 1792, fp32=104.8, tf32=104.8, fp16=209.5,
                        fp8=419.0)),
    (r"RTX 4090$", _row("RTX 4090", _ADA, 1008, fp32=82.6, tf32=82.6, fp16=165.2, fp8=330.3)),
    (r"RTX 3090$", _row("RTX 3090", _AMPERE, 936, fp32=35.6, tf32=35.6, fp16=71.0, fp8=None)),
]
_NOT_THE_PART = re.compile(r"Laptop|Mobile|Max-Q|\bGH200\b|\bGH100\b|\bGB200\b")
# cards left out for want of a page that sources their row (the pages held give no dense tensor rate, or one the
# chip cannot reach); docs/roofline.md lists them, and --gpu names them when refused
MISSING = ("RTX PRO 6000 Blackwell Max-Q and Server editions (other power and clocks than the Workstation "
           "Edition's row; no page held gives their tensor rates)",
           "RTX 5090 Laptop (the one page held gives 113.99 TF FP16 without the clock or accumulation it assumes: "
           "at the 2,160 MHz top boost its 82 SMs give 90.7 with FP32 accumulation, 181.4 with FP16)",
           "RTX 4080 Laptop and RTX 3080 Laptop (no tensor rate)",
           "GB200 (no row of its GPU's own; its power and clocks are not a B200's)")


def datasheet_row(gpu_name: str | None) -> dict | None:
    """The datasheet row of ``gpu_name`` (torch's device name), or None: unknown, or a MIG slice. A laptop or Grace
    part (``_NOT_THE_PART``) matches only a row that names such a part, never its desktop or datacenter namesake."""
    if not gpu_name or "MIG" in gpu_name:
        return None
    name = gpu_name.strip()
    row = next((row for pattern, row in DATASHEET if re.search(pattern, name)), None)
    if row and _NOT_THE_PART.search(name) and not _NOT_THE_PART.search(row["name"]):
        return None  # a laptop or Grace part matches a row of its own or none
    return row


def datasheet_peak(gpu_name: str | None, precision: str) -> float | None:
    """The dense peak (TFLOP/s) in column ``precision`` (a rung's ``datasheet``), if known."""
    row = datasheet_row(gpu_name)
    return row.get(precision) if row else None


def memory_bandwidth_gbps(gpu_name: str | None) -> float | None:
    """The datasheet memory bandwidth (GB/s), if known."""
    row = datasheet_row(gpu_name)
    return row["bandwidth_gbps"] if row else None


def train_flops_per_image(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """FLOPs of one forward + backward per image, counted in fp32 on a copy of the model."""
    probe = copy.deepcopy(model).float().train()
    counter = FlopCounterMode(display=False)
    with counter:
        loss = F.cross_entropy(probe(x.float()), y)
        loss.backward()
    return counter.get_total_flops() / len(y)
