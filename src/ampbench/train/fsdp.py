"""FSDP2 (``torch.distributed.fsdp.fully_shard``) as the second data-parallel strategy: the model sharded over the
ranks, each block on its own and then the root, its mixed precision a ``MixedPrecisionPolicy``.

What a precision buys here is memory per rank and bytes on the wire, besides the tensor cores' time: the fp32
master weights, their gradients and the optimizer's state stay sharded 1/N; each block's parameters are
all-gathered in ``param_dtype`` for its forward (and again for its backward, when they are resharded after the
forward) and its gradients reduce-scattered in ``reduce_dtype``. The rungs map as the anchors map them:

- fp32, tf32: no policy (fp32 on the wire; tf32 is the matmul's arithmetic, not a storage dtype);
- bf16: ``param_dtype=bf16``, ``reduce_dtype`` fp32 (torchtitan's default) or bf16 (Accelerate's), the
  ``reduce_dtype`` setting;
- fp16: ``param_dtype=fp16``, fp32 reduce, and the rung's ``torch.amp.GradScaler`` over the DTensor gradients:
  each rank holds a shard of every gradient, so an inf is in one rank's shard alone, and the scaler's inf check,
  dispatched on DTensors, reduces its found-inf over the ranks, so every rank skips the step (tests/test_fsdp.py);
- fp8 (tensorwise): torchao's float8 all-gather, as torchtitan runs it: each converted weight's shard is cast to
  fp8 with the scale of the whole weight (its amax all-reduced once per step after the optimizer's, torchao's
  ``precompute_float8_dynamic_scale_for_fsdp``) and gathered in fp8; the rest of a block in bf16, the reduce as
  bf16's. The fp8 weights are those DDP's converted layers cast from the same fp32 weights, bit for bit.

The autocast of the rung runs as under DDP (the numerically sensitive ops stay fp32), over the gathered copies,
on the activations as DDP's see them: a block's policy does not cast its inputs, and the root's own parameters
(a ViT's class token and position embedding, added to the residual stream) stay fp32. BatchNorm layers keep fp32
parameters (sharded on their own), as FSDP1 keeps them by default and as autocast runs them: a bf16 weight beside
fp32 running statistics is refused by the kernel.

``train.compile`` compiles each block's forward in place, as torchtitan compiles its blocks under FSDP2 (the root's
own layers, a ResNet's stem and head, stay eager): FSDP's hooks around a block's forward, its all-gather and its
reshard, run eagerly, where compiling the sharded root would break the graph at every one of them; the module and
its state dict keep their names, so a checkpoint and model.pt are the same compiled or not. A block holding a unit
of its own (a BatchNorm under a policy) stays eager for the same reason (``compilable``), and the run says which.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn

from ampbench.errors import ConfigError

REDUCE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def param_dtype(precision: str) -> torch.dtype | None:
    """The dtype a rung's blocks are all-gathered in: its autocast dtype (a converting rung's converted weights in
    its own format, ``Rung.fsdp_low_weights``); None for a rung without autocast (fp32, tf32: no policy)."""
    from ampbench.precision import rung
    a = rung(precision).autocast
    return getattr(torch, a) if a else None


def _state(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The optimizer's per-parameter state tensors (its scalars, a step count, left out)."""
    return [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.dim()]


def state_per_param(opt: torch.optim.Optimizer, trained: int) -> int:
    """The optimizer's state values per trained parameter, as it holds them after a step (SGD's momentum 1, Adam's
    2): its tensors' global sizes (a DTensor's numel is the whole one's) over the trained parameters."""
    return round(sum(v.numel() for v in _state(opt)) / max(1, trained))


def blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The modules sharded on their own, each all-gathered for its own forward and freed after: in a
    ``Sequential`` or ``ModuleList``, the children of a class (not itself a container) that it holds two or more
    of, with parameters and parts of their own (a ResNet's residual blocks, a ViT's encoder layers, a
    MobileNet's inverted residuals); where there are none, the top-level children with parameters (a small
    network's stages, a user's factory's parts). Named as ``named_modules`` names them; the rest stays with the
    root."""
    containers = nn.Sequential | nn.ModuleList
    found, taken = [], []
    for name, module in model.named_modules():
        if not isinstance(module, containers) or any(name.startswith(t) for t in taken):
            continue
        kids = [(n, k) for n, k in module.named_children() if not isinstance(k, containers)
                and any(True for _ in k.children()) and _has_params(k)]
        counts: dict[type, int] = {}
        for _, k in kids:
            counts[type(k)] = counts.get(type(k), 0) + 1
        picked = [(f"{name}.{n}" if name else n, k) for n, k in kids if counts[type(k)] >= 2]
        found += picked
        taken += [f"{n}." for n, _ in picked]
    if found:
        return found
    return [(n, k) for n, k in model.named_children() if _has_params(k)]


def _has_params(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


def policy(precision: str, reduce_dtype: str = "fp32"):
    """The ``MixedPrecisionPolicy`` of a rung (None where it has none: fp32, tf32)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy
    low = param_dtype(precision)
    if low is None:
        return None
    if reduce_dtype not in REDUCE_DTYPES:
        raise ConfigError(f"distributed.fsdp_reduce_dtype = {reduce_dtype!r}: use fp32 or bf16")
    reduce = REDUCE_DTYPES["fp32"] if low == torch.float16 else REDUCE_DTYPES[reduce_dtype]  # fp16 reduces in fp32
    return MixedPrecisionPolicy(param_dtype=low, reduce_dtype=reduce)


def shard(model: nn.Module, world, device_kind: str, precision: str, reduce_dtype: str = "fp32",
          reshard_after_forward: bool = True) -> nn.Module:
    """``model`` sharded in place over ``world``'s ranks (a 1-D device mesh of the device type trained on, so a gloo
    run's parameters stay on the CPU): each of its ``blocks``, then the root. Every rank must hold the same
    weights first (built from one seed); the same module comes back, its parameters DTensor shards: make the
    optimizer after this. A channels_last model's weights are made contiguous first (FSDP2 refuses others)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    mesh = init_device_mesh(device_kind, (world.size,))
    mp = policy(precision, reduce_dtype) or MixedPrecisionPolicy()
    model.to(memory_format=torch.contiguous_format)  # FSDP2 shards contiguous parameters only; the convolutions
    # still run channels_last where their inputs are (cuDNN follows the input's layout)
    # fp32 where autocast keeps it: BatchNorm's parameters (as FSDP1 keeps them), the root's own (a ViT's class
    # token and position embedding, added to the stream) and the activations between blocks, which a block's policy
    # leaves uncast (autocast casts each op's inputs as under DDP)
    fp32 = MixedPrecisionPolicy(reduce_dtype=mp.reduce_dtype)
    low = MixedPrecisionPolicy(param_dtype=mp.param_dtype, reduce_dtype=mp.reduce_dtype, cast_forward_inputs=False)
    for name, size, _, _ in units(model, precision, reduce_dtype)[:-1]:
        fully_shard(model.get_submodule(name), mesh=mesh, mp_policy=fp32 if size == 4 else low,
                    reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, mp_policy=fp32, reshard_after_forward=reshard_after_forward)
    return model


def units(model: nn.Module, precision: str, reduce_dtype: str = "fp32") -> list[tuple[str, int, int, int]]:
    """What ``shard`` shards on its own, inner first: (its name, the bytes of a value it is all-gathered in, its
    parameters not in an inner unit, of those the ones gathered in fp8). Under a policy each BatchNorm with
    parameters (fp32), then each of the ``blocks`` (``param_dtype``), then the root's own (fp32)."""
    from ampbench.precision import rung
    p = policy(precision, reduce_dtype)
    low = p.param_dtype.itemsize if p else 4
    in_fp8 = rung(precision).fsdp_low_weights(model)
    found, taken = [], set()
    norms = [(n, m) for n, m in model.named_modules() if p is not None
             and isinstance(m, nn.modules.batchnorm._BatchNorm) and _has_params(m)]
    for (name, module), size in [*((nm, 4) for nm in norms), *((b, low) for b in blocks(model)), (("", model), 4)]:
        own = [q for q in module.parameters() if id(q) not in taken]
        taken.update(id(q) for q in own)
        found.append((name, size, sum(q.numel() for q in own), sum(q.numel() for q in own if id(q) in in_fp8)))
    return found


# Graphs a block's forward may need: one per distinct block and per shape and grad mode it runs in (training's
# batch, evaluation's, its last, a rank's empty slice of it). Blocks of a class share one code object, and so do
# the models a process builds (the step profile's beside training's), so dynamo counts their graphs together: at
# its default limit (8) a ResNet-18's blocks fell back to eager in evaluation, a ResNet-50's in training
GRAPHS_PER_BLOCK, MIN_GRAPHS = 8, 64


def compilable(model: nn.Module, precision: str, reduce_dtype: str = "fp32") -> tuple[list[str], list[str]]:
    """(the blocks ``compile_blocks`` compiles, those it leaves eager): a block holding an FSDP unit of its own (a
    BatchNorm under a precision policy, sharded apart in fp32) stays eager, as its unit's hooks, which dynamo runs
    eagerly, would break the block's graph at every one of them."""
    inner = [name for name, *_ in units(model, precision, reduce_dtype)[:-1]]
    compiled, eager = [], []
    for name, _ in blocks(model):
        (eager if any(n.startswith(f"{name}.") for n in inner) else compiled).append(name)
    return compiled, eager


def compile_blocks(model: nn.Module, precision: str, reduce_dtype: str = "fp32") -> tuple[list[str], list[str]]:
    """Each block ``compilable`` names with its forward compiled (``torch.compile``), in place, before the model is
    sharded; (the blocks compiled, those left eager)."""
    import inspect
    compiled, eager = compilable(model, precision, reduce_dtype)
    limit = max(MIN_GRAPHS, GRAPHS_PER_BLOCK * len(compiled))
    from torch._dynamo import config as dynamo
    if hasattr(dynamo, "accumulated_recompile_limit"):  # the cap over every compile of one code object
        dynamo.accumulated_recompile_limit = max(dynamo.accumulated_recompile_limit, limit)
    if "recompile_limit" in inspect.signature(torch.compile).parameters:  # this compile's own limit
        kw = {"recompile_limit": limit}
    else:  # an older torch: dynamo's one limit for the process (cache_size_limit before it was renamed)
        name = "recompile_limit" if hasattr(dynamo, "recompile_limit") else "cache_size_limit"
        setattr(dynamo, name, max(getattr(dynamo, name), limit))
        kw = {}
    for name in compiled:
        block = model.get_submodule(name)
        block.forward = torch.compile(block.forward, **kw)  # the instance's own: its hooks stay outside the graph
    return compiled, eager


def after_each_step(model: nn.Module, opt: torch.optim.Optimizer, precision: str) -> None:
    """What a sharded model with weights gathered in a low format needs after each optimizer step, hooked on the
    optimizer (fp8: the scales of its next all-gathers, ``Rung.fsdp_after_step``); nothing for the others."""
    from ampbench.precision import rung
    r = rung(precision)
    if r.fsdp_low_weights(model):
        opt.register_step_post_hook(lambda *_: r.fsdp_after_step(model))


def is_sharded(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule
    return isinstance(model, FSDPModule)


@contextmanager
def no_gradient_sync(model: nn.Module):
    """A micro-batch whose gradients stay unsharded and local: all but the last of an optimizer step's, so the
    gradients are reduce-scattered once per step (``distributed.sync_context``)."""
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def full(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's whole value on every rank (a collective: every rank calls it); a plain tensor as it is. A total
    gradient norm over shards is one: the norm that clipping applied, not one shard's."""
    from torch.distributed.tensor import DTensor
    return t.full_tensor() if isinstance(t, DTensor) else t


def holds_shards(state: dict) -> bool:
    """Whether a model state dict holds DTensor shards (a sharded model's own ``state_dict()``), not whole tensors
    (a checkpoint's)."""
    from torch.distributed.tensor import DTensor
    return any(isinstance(v, DTensor) for v in state.values())


def full_state(model: nn.Module, opt: torch.optim.Optimizer | None = None,
               everywhere: bool = False) -> tuple[dict, dict | None]:
    """A sharded model's (and optimizer's) whole state, on the CPU, on rank 0 (the others get empty dicts; with
    ``everywhere``, on every rank, on its device): a collective, every rank calls it. What a checkpoint and the
    trained weights hold, as under DDP."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True, cpu_offload=not everywhere)
    return (get_model_state_dict(model, options=options),
            None if opt is None else get_optimizer_state_dict(model, opt, options=options))


def load_full_state(model: nn.Module, opt: torch.optim.Optimizer, model_state: dict, opt_state: dict,
                    precision: str) -> None:
    """A whole state (``full_state``'s, from a checkpoint every rank read) sharded into ``model`` and ``opt``, with
    what the loaded weights need of ``precision`` (fp8: their scales, not the ones they replaced)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    from ampbench.precision import rung
    options = StateDictOptions(full_state_dict=True)
    set_model_state_dict(model, model_state, options=options)
    set_optimizer_state_dict(model, opt, opt_state, options=options)
    r = rung(precision)
    if r.fsdp_low_weights(model):
        r.fsdp_after_step(model)


def wire_bytes(model: nn.Module, world_size: int, precision: str, reduce_dtype: str = "fp32",
               reshard_after_forward: bool = True, accum_steps: int = 1) -> dict[str, dict]:
    """Bytes each rank sends per optimizer step, by collective, counted from the dtypes: every unit's parameters
    (``units``: the blocks' in ``param_dtype``, BatchNorm's and the root's own in fp32) all-gathered for each
    micro-batch's forward, and again for its backward when resharded after the forward ((N-1)/N of them each
    time), and the trained parameters' gradients reduce-scattered once per step in ``reduce_dtype`` ((N-1)/N as
    well). A ring's figures, shards unpadded; under gloo a reduce-scatter runs as an all-reduce."""
    p = policy(precision, reduce_dtype)
    share = (world_size - 1) / world_size
    trained = sum(q.numel() for q in model.parameters() if q.requires_grad)
    gathers = accum_steps * (2 if reshard_after_forward else 1)
    by_dtype: dict[str, int] = {}
    for _, size, count, fp8 in units(model, precision, reduce_dtype):
        name = {4: "float32", 2: str(p.param_dtype if p else "").removeprefix("torch.")}[size]
        for dtype, n, itemsize in ((name, count - fp8, size), ("float8_e4m3fn", fp8, 1)):
            if n:
                by_dtype[dtype] = by_dtype.get(dtype, 0) + int(gathers * share * n * itemsize)
    reduce = p.reduce_dtype if p else torch.float32
    return {"all_gather": {"dtype": str(p.param_dtype if p else torch.float32).removeprefix("torch."),
                           "bytes": sum(by_dtype.values()), "by_dtype": by_dtype, "per_step": gathers},
            "reduce_scatter": {"dtype": str(reduce).removeprefix("torch."),
                               "bytes": int(share * trained * reduce.itemsize), "per_step": 1}}


def memory_parts(model: nn.Module, world_size: int, precision: str, reduce_dtype: str = "fp32",
                 optimizer_state_per_param: int = 1, accum_steps: int = 1) -> dict[str, int]:
    """Bytes per rank of what FSDP keeps, counted: the fp32 parameters' shard (1/N), the gradients' shard in fp32
    (1/N), the optimizer's state (``optimizer_state_per_param`` fp32 values per trained parameter, 1/N: SGD's
    momentum 1, Adam's 2); the two largest units' unsharded copies while all-gathered (the one running and the one
    prefetched) and the largest one's unsharded gradients in ``reduce_dtype`` until they are reduce-scattered; and
    with accumulation, every gradient whole in ``reduce_dtype`` from the first micro-batch to the last (the
    reduce-scatter waits for it)."""
    p = policy(precision, reduce_dtype)
    reduce_size = (p.reduce_dtype if p else torch.float32).itemsize
    params = sum(q.numel() for q in model.parameters())
    trained = sum(q.numel() for q in model.parameters() if q.requires_grad)
    found = sorted(((size * (count - fp8) + fp8, count)
                    for _, size, count, fp8 in units(model, precision, reduce_dtype)), reverse=True)
    parts = {"parameters": -(-params * 4 // world_size), "gradients": -(-trained * 4 // world_size),
             "optimizer_state": -(-trained * 4 * optimizer_state_per_param // world_size),
             "gathered_blocks": sum(b for b, _ in found[:2]),
             "unsharded_block_gradients": max(c for _, c in found) * reduce_size}
    if accum_steps > 1:
        parts["accumulated_gradients"] = trained * reduce_size
    return parts


def describe(model: nn.Module, opt: torch.optim.Optimizer, world_size: int, plan,
             compiled: tuple[list[str], list[str]] = ([], [])) -> dict:
    """What a sharded run's metrics say of its sharding (``plan``: its RunPlan): the blocks, those compiled and
    left eager (``compiled``: ``compile_blocks``' answer), the dtypes, the bytes on the wire per optimizer step and
    the memory per rank by part, counted, with what this rank holds of the parameters and the optimizer's state,
    measured."""
    def held(tensors) -> int:
        return sum(t.to_local().numel() * t.element_size() if hasattr(t, "to_local") else t.nbytes for t in tensors)
    p = policy(plan.precision, plan.fsdp_reduce_dtype)
    trained = sum(q.numel() for q in model.parameters() if q.requires_grad)
    return {"blocks": [n for n, _ in blocks(model)], "compiled_blocks": compiled[0], "eager_blocks": compiled[1],
            "world_size": world_size,
            "param_count": sum(q.numel() for q in model.parameters()), "trained_count": trained,
            "state_per_param": state_per_param(opt, trained),
            "param_dtype": str(p.param_dtype).removeprefix("torch.") if p else "float32",
            "reduce_dtype": str(p.reduce_dtype).removeprefix("torch.") if p else "float32",
            "wire_bytes_per_step": wire_bytes(model, world_size, plan.precision, plan.fsdp_reduce_dtype,
                                              accum_steps=plan.accum_steps),
            "memory_per_rank": memory_parts(model, world_size, plan.precision, plan.fsdp_reduce_dtype,
                                            state_per_param(opt, trained), plan.accum_steps),
            "held_here": {"parameters": held(q.detach() for q in model.parameters()),
                          "optimizer_state": held(_state(opt))}}
