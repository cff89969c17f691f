"""The roofline for N GPUs of one node: each precision's step on one GPU (``roofline.step_time`` at the global batch's
share) beside the bytes its data-parallel collectives send per step at the GPUs' interconnect bandwidth, so a user
sees whether the collectives or the kernels bound the step before owning the machines.

``LINKS``: per datasheet row, the GPU-to-GPU links its datasheet gives, in GB/s per GPU as datasheets print them
(both directions together): NVLink (through an NVSwitch to every GPU of an HGX board, or a bridge joining 2 or 4
cards) and the PCIe slot. A ring collective sends and receives at once, so each GPU sends at half that figure.
None: no source gives it (the row says n/a and why). What each rank sends (``train.fsdp``'s counts):

- DDP: a ring all-reduce of the trained parameters' gradients, 2 (N-1)/N of them, in fp32 (the gradients of the
  fp32 weights, whatever the autocast);
- FSDP: every unit's parameters all-gathered in ``param_dtype`` for the forward and again for the backward, and the
  gradients reduce-scattered in ``reduce_dtype``, (N-1)/N each time.

The step is the longer of the kernels' and the collectives' times (both overlapped, as DDP's buckets and FSDP's
prefetch overlap them at best): the least time, like the rest of the roofline. NCCL reaches about 80% of a link's
figure, and a PCIe ring of GeForce cards without peer-to-peer goes through host memory, slower still.
"""

from __future__ import annotations

import math

from ampbench.errors import ConfigError

NODE = 8  # the GPUs of one node (an HGX board): --nproc beyond it crosses the network, which no row gives

_H100 = "NVIDIA H100 Tensor Core GPU datasheet, interconnect row"
_H200 = "NVIDIA H200 Tensor Core GPU datasheet, interconnect row"
_A100 = "NVIDIA A100 Tensor Core GPU datasheet, interconnect row"
_GEN3, _GEN4, _GEN5 = ("PCIe Gen3 x16", 32), ("PCIe Gen4 x16", 64), ("PCIe Gen5 x16", 128)


def _link(source: str, pcie: tuple[str, float] | None, nvlink: float | None = None, joins: int = 0,
          how: str = "", sxm_joins: int = 0) -> dict:
    """A row's links; ``sxm_joins``: the GPUs its NVLink joins when the GPU is named as its SXM part (a row that
    holds both the SXM board and the PCIe card)."""
    return {"source": source, "pcie": pcie, "nvlink_gbps": nvlink, "nvlink_gpus": joins, "nvlink_how": how,
            "sxm_joins": sxm_joins}


_SWITCH = "NVLink through NVSwitch"
_BRIDGE = "an NVLink bridge"
LINKS: dict[str, dict | None] = {
    "B200": _link("NVIDIA HGX B200 datasheet (fifth-generation NVLink, 1.8 TB/s per GPU)", None, 1800, 8, _SWITCH),
    "GH200 144GB HBM3e": None,  # NVLink-C2C is the link to its own Grace CPU; GPU to GPU goes over the network
    "GH200 96GB HBM3": None,
    "H200 NVL": _link(_H200 + " (2- or 4-way NVLink bridge, 900 GB/s per GPU; PCIe Gen5 128 GB/s)", _GEN5, 900, 4,
                      _BRIDGE),
    "H200": _link(_H200 + " (SXM: NVLink 900 GB/s, PCIe Gen5 128 GB/s)", _GEN5, 900, 8, _SWITCH),
    "H100 NVL": _link(_H100 + " (NVL: NVLink bridge 600 GB/s for a pair, PCIe Gen5 128 GB/s)", _GEN5, 600, 2, _BRIDGE),
    "H100 SXM": _link(_H100 + " (SXM: NVLink 900 GB/s, PCIe Gen5 128 GB/s)", _GEN5, 900, 8, _SWITCH),
    "H100 PCIe": _link(_H100 + " (PCIe: NVLink bridge 600 GB/s for a pair, PCIe Gen5 128 GB/s)", _GEN5, 600, 2,
                       _BRIDGE),
    "A100 80GB PCIe": _link(_A100 + " (PCIe: NVLink bridge for 2 GPUs 600 GB/s, PCIe Gen4 64 GB/s)", _GEN4, 600, 2,
                            _BRIDGE),
    "A100 80GB SXM": _link(_A100 + " (SXM: NVLink 600 GB/s, PCIe Gen4 64 GB/s)", _GEN4, 600, 8, _SWITCH),
    # the 40GB row is the SXM4 and the PCIe card alike: NVLink to one other GPU at least (a bridge)
    "A100 40GB": _link(_A100 + " (NVLink 600 GB/s: SXM through NVSwitch, PCIe cards bridged in pairs; PCIe Gen4 "
                       "64 GB/s)", _GEN4, 600, 2, "NVLink (taken as a PCIe card's bridge: an SXM4 board joins 8)",
                       sxm_joins=8),
    "L40S": _link("NVIDIA L40S datasheet (PCIe Gen4 x16 64 GB/s bidirectional, no NVLink)", _GEN4),
    "L4": _link("NVIDIA L4 Tensor Core GPU datasheet (PCIe Gen4 x16 64 GB/s, no NVLink)", _GEN4),
    "A40": _link("NVIDIA A40 datasheet (NVLink bridge 112.5 GB/s bidirectional for 2 GPUs, PCIe Gen4 64 GB/s)",
                 _GEN4, 112.5, 2, _BRIDGE),
    "A10": _link("NVIDIA A10 datasheet (PCIe Gen4 64 GB/s, no NVLink)", _GEN4),
    "V100S PCIe": _link("NVIDIA V100 datasheet, V100S PCIe column (PCIe Gen3 32 GB/s)", _GEN3),
    "V100": _link("NVIDIA V100 Tensor Core GPU datasheet (SXM2: NVLink 300 GB/s, PCIe Gen3 32 GB/s)", _GEN3, 300, 8,
                  "NVLink (a DGX-1's hybrid cube mesh)"),
    "V100 PCIe": _link("NVIDIA V100 Tensor Core GPU datasheet (PCIe: PCIe Gen3 32 GB/s)", _GEN3),
    "T4": _link("NVIDIA T4 datasheet (PCIe Gen3 x16, 32 GB/s)", _GEN3),
    "RTX 6000 Ada": _link("NVIDIA RTX 6000 Ada datasheet (PCIe Gen4 x16, no NVLink)", _GEN4),
    "RTX A6000": _link("NVIDIA RTX A6000 datasheet (NVLink bridge 112.5 GB/s bidirectional for 2 cards, PCIe Gen4 "
                       "x16)", _GEN4, 112.5, 2, _BRIDGE),
    "RTX 4090 Laptop": None,  # a laptop's one GPU
    "RTX PRO 6000 Blackwell": _link("NVIDIA RTX PRO 6000 Blackwell datasheet (PCIe Gen5 x16, no NVLink)", _GEN5),
    "RTX 5090": _link("NVIDIA GeForce RTX 5090 specifications (PCIe Gen5 x16, no NVLink)", _GEN5),
    "RTX 4090": _link("NVIDIA GeForce RTX 4090 specifications (PCIe Gen4 x16, no NVLink)", _GEN4),
    "RTX 3090": _link("NVIDIA Ampere GA102 GPU architecture whitepaper (third-generation NVLink, 112.5 GB/s total "
                      "between two GPUs; PCIe Gen4 x16)", _GEN4, 112.5, 2, _BRIDGE),
}


def link(row: dict, nproc: int, named: str = "") -> dict | None:
    """The link ``nproc`` GPUs of ``row``'s kind train over: NVLink where it joins that many, else the PCIe slot;
    ``{"name", "gbps" (both directions, as printed), "source"}``, or None where no source gives one. ``named``: the
    GPU as the user named it (a row's SXM part, named so, sits on an NVSwitch board: ``sxm_joins``)."""
    found = LINKS.get(row["name"])
    if not found:
        return None
    if found["sxm_joins"] and "SXM" in named.upper():
        found = {**found, "nvlink_gpus": found["sxm_joins"], "nvlink_how": _SWITCH}
    if found["nvlink_gbps"] and nproc <= found["nvlink_gpus"]:
        return {"name": found["nvlink_how"], "gbps": found["nvlink_gbps"], "source": found["source"]}
    if found["pcie"]:
        name, gbps = found["pcie"]
        return {"name": name + (f" (NVLink joins {found['nvlink_gpus']} only)" if found["nvlink_gbps"] else ""),
                "gbps": gbps, "source": found["source"]}
    return None


def model_counts(cfg, make_optimizer):
    """params.yaml's model on meta tensors, and the optimizer's fp32 state values per trained parameter (its state
    after one step: SGD's momentum 1, Adam's 2)."""
    import torch

    from ampbench import data, models
    from ampbench.train.fsdp import state_per_param
    desc = data.describe(cfg.data)
    model = models.build_meta(cfg.model, num_classes=desc["num_classes"],
                              image_size=models.input_size(cfg.model, desc["image_size"]))
    trained = [q for q in model.parameters() if q.requires_grad]
    for q in trained:
        q.grad = torch.zeros_like(q)
    opt = make_optimizer(trained, cfg.train)
    opt.step()
    for q in trained:
        q.grad = None
    return model, state_per_param(opt, sum(q.numel() for q in trained))


def check(nproc: int, strategy: str) -> None:
    """A node's GPUs and a strategy, or a ConfigError naming the bad value."""
    if not 1 <= nproc <= NODE:
        raise ConfigError(f"--nproc {nproc}: give 1 to {NODE} GPUs (one node; across nodes the network bounds the "
                          "collectives, and no row of the table gives it)")
    if strategy not in ("ddp", "fsdp"):
        raise ConfigError(f"--strategy {strategy!r}: use ddp or fsdp")


def table(ops: dict[str, list], row: dict, model, state_per_param: int, nproc: int, strategy: str,
          global_batch: int, reduce_dtype: str = "fp32", launch_us: float | None = None,
          prepare=None, refusals: dict[str, str] | None = None, found: dict | None = None) -> dict[str, dict]:
    """Per precision on ``nproc`` GPUs of ``row``'s kind (``ops`` counted at one GPU's share of ``global_batch``):
    one GPU's kernel step, the bytes each GPU sends per step and their time on the link, the step (the longer of
    the two), img/s over all GPUs, what bounds it, and the memory per GPU by part (counted; activations on top).
    ``prepare(precision, model)``: ``model`` (meta) as that precision shards it (fp8: converted, its weights
    gathered in fp8); by default as it is. ``refusals``: why a precision would not train under FSDP here
    (``runplan.fsdp_refusal``), its row n/a. ``found``: the link (``link``'s, as the GPU was named; by default
    the row's own)."""
    refusals = refusals or {}
    from ampbench.measure import roofline
    from ampbench.report.sharded import ddp_counted
    from ampbench.train import fsdp
    found = found or link(row, nproc)
    launch_us = roofline.LAUNCH_US if launch_us is None else launch_us
    out = {}
    trained = sum(q.numel() for q in model.parameters() if q.requires_grad)
    params = sum(q.numel() for q in model.parameters())
    for p, p_ops in ops.items():
        why = roofline.unavailable(p, p_ops, row)
        if not why and strategy == "fsdp":
            why = refusals.get(p)
        t = None if why else roofline.step_time(p_ops, row, p, launch_us)
        if t is None:
            out[p] = {"na": why or f"no {p} rate on {row['name']} for a dtype this step runs in"}
            continue
        if strategy == "fsdp":
            own = prepare(p, model) if prepare else model
            wire = fsdp.wire_bytes(own, nproc, p, reduce_dtype)
            memory = fsdp.memory_parts(own, nproc, p, reduce_dtype, state_per_param)
        else:
            counted = ddp_counted(params, trained, state_per_param, nproc)
            wire = {"all_reduce": {"dtype": "float32", "bytes": counted["wire_bytes_per_step"], "per_step": 1}}
            memory = counted["memory_parts"]
        sent = sum(c["bytes"] for c in wire.values())
        comm_s = sent / (found["gbps"] / 2 * 1e9) if found and nproc > 1 else (0.0 if nproc == 1 else None)
        step_s = max(t["step_s"], comm_s or 0.0)
        out[p] = {"gpu_step_ms": t["step_s"] * 1e3, "launch_bound": t["launch_bound"], "sent_bytes": sent,
                  "wire": wire, "comm_ms": None if comm_s is None else comm_s * 1e3,
                  "step_ms": None if comm_s is None else step_s * 1e3,
                  "imgs_per_s": None if comm_s is None else global_batch / step_s,
                  "bound": None if comm_s is None else ("collectives" if comm_s > t["step_s"] else
                                                        "launches" if t["launch_bound"] else "kernels"),
                  "memory_per_gpu": memory}
    return out


def share(global_batch: int, nproc: int) -> int:
    """One GPU's images per step: the global batch split over the GPUs (the last ones get one fewer); a batch
    smaller than the GPUs is refused (a GPU without an image)."""
    if global_batch < nproc:
        raise ConfigError(f"a global batch of {global_batch} over {nproc} GPUs leaves a GPU without an image; give "
                          f"--batch {nproc} or more (or fewer GPUs)")
    return math.ceil(global_batch / nproc)
