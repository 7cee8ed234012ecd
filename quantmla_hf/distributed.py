"""The weights and devices one process computes with when a model is split: tensor parallel, device maps, offload.

Tensor parallel (`from_pretrained(..., tp_plan="auto")` in transformers 5.17, `distributed_config=
DistributedConfig(tp_plan="auto")` from then on): parameters become DTensors. Plans that shard attention
(deepseek_v2, minicpm3, glm4_moe_lite, longcat_flash) split `q_proj`/`q_b_proj` and `kv_b_proj` column-wise, so
rank r of n holds the query heads `[r H/n, (r+1) H/n)` and the matching rows of `kv_b_proj`
(`[H/n * (d_nope + d_v), d_c]`), and `o_proj` row-wise, which sums the heads of all ranks. `kv_a_proj_with_mqa`
is not split: every rank computes the same latent `c` and `k_R`, so the QuantMLA cache (one latent per token,
shared by all heads) is replicated, whole, on every rank. The native decode therefore absorbs the local shard of
`kv_b_proj` into the local query heads. Plans that leave attention alone (deepseek_v3) need nothing.

Device maps: accelerate runs each layer on its own device, or streams offloaded weights (CPU or disk, `meta`
in the module) onto the execution device for each submodule's forward. The cache allocates each layer's planes
where that layer's latents are computed (`QuantMLALayer.lazy_initialization`), Triton kernels launch on the
device of their tensors (`device_guard`), and the decode reads `kv_b_proj`'s weight on the execution device
(`kv_b_weight`).

Learned, smooth and Hadamard transforms are fused into the attention weights by `calibration.calibrate`, one
process over whole weights; a sharded model is refused (`check_not_sharded_for_calibration`): calibrate in one
process, `save_pretrained`, and load that fused checkpoint with tensor parallel.

Decode steps replayed from CUDA graphs (`quantmla_hf.generation.graphs`) hold the collectives of a tensor-parallel step
(the row-parallel all-reduces) inside the graph. NCCL counts every live graph that captured a collective on a
communicator, and destroying the communicator (`destroy_process_group`, or the process group's destructor at exit,
which aborts it) waits until that count is zero: a process whose model still holds its graphs never exits. Hence
`release_before_shutdown`: the graphs are released before any process group is destroyed and at interpreter exit.
Collectives of another backend (gloo) cannot be captured: `uncapturable_collectives` says so and the decode runs
eagerly.
"""

from __future__ import annotations

import atexit
import contextlib
import functools

import torch
import torch.distributed
from accelerate.utils import align_module_device, has_offloaded_params

CALIBRATE_THEN_SHARD = (
    "calibrate in one process first, without tensor parallel (e.g. `quantmla quantize MODEL --out DIR "
    "--calibration FILE`, or from_pretrained(MODEL, quantization_config=QuantMLAConfig(transform={transform!r}, "
    "calibration_data=...), device_map='auto') then save_pretrained(DIR)), and load the fused checkpoint DIR with "
    "tensor parallel: it is marked calibrated and is not calibrated again"
)


def _dtensor_type():
    if not torch.distributed.is_available():
        return None
    from torch.distributed.tensor import DTensor

    return DTensor


def is_dtensor(t) -> bool:
    dtensor = _dtensor_type()
    return dtensor is not None and isinstance(t, dtensor)


def local_rows(weight: torch.Tensor, what: str) -> torch.Tensor:
    """This rank's rows of a `[out, in]` linear weight: the weight itself, or a DTensor's local shard.

    Only whole rows can be used on their own: a DTensor must be replicated or sharded along dim 0 on every mesh
    dimension; anything else (a shard of the input dimension, a pending partial sum) is a `ValueError`.
    """
    if not is_dtensor(weight):
        return weight
    from torch.distributed.tensor import Replicate, Shard

    placements = tuple(weight.placements)
    if not all(isinstance(p, Replicate) or (isinstance(p, Shard) and p.dim == 0) for p in placements):
        raise ValueError(
            f"{what} is distributed as {placements}; QuantMLA's latent decode needs whole rows of it (the heads of "
            "this rank), i.e. a tensor-parallel plan with 'colwise' for kv_b_proj and q_proj/q_b_proj, or none for "
            "attention"
        )
    return weight.to_local()


def kv_b_weight(module: torch.nn.Module, num_heads: int, device: torch.device) -> torch.Tensor:
    """`kv_b_proj.weight` rows of the `num_heads` query heads this process computes, on `device`.

    `[num_heads * (d_nope + d_v), d_c]`: the whole weight on one process, the local shard under tensor parallel,
    and for accelerate-offloaded weights (`meta` in the module) a copy loaded from the offload map.
    """
    linear = module.kv_b_proj
    weight = linear.weight
    if weight.device.type == "meta":
        if not has_offloaded_params(linear):
            raise ValueError(
                f"kv_b_proj of attention layer {module.layer_idx} is on the meta device without an accelerate "
                "offload hook; load the model's weights (from_pretrained or load_state_dict) before generating"
            )
        with align_module_device(linear, device):
            weight = linear.weight  # kept alive by this reference after the hook puts `meta` back
    weight = local_rows(weight, f"kv_b_proj of attention layer {module.layer_idx}")
    per_head = module.qk_nope_head_dim + module.v_head_dim
    if weight.shape[0] != num_heads * per_head:
        raise ValueError(
            f"kv_b_proj of attention layer {module.layer_idx} holds {weight.shape[0]} rows in this process but the "
            f"query has {num_heads} heads x (d_nope + d_v = {per_head}) = {num_heads * per_head}; under tensor "
            "parallel, kv_b_proj and q_proj/q_b_proj must be split by the same heads ('colwise' on both, with the "
            "head count divisible by the tensor-parallel size) or both left whole"
        )
    return weight.to(device)


def device_guard(device: torch.device):
    """Make `device` current for the block (Triton launches on the current CUDA device); nothing off CUDA."""
    if device.type == "cuda":
        return torch.cuda.device(device)
    return contextlib.nullcontext()


def sharded_parameter_names(module: torch.nn.Module) -> list[str]:
    """Names of `module`'s parameters that are DTensors not replicated on every rank (tensor parallel, FSDP)."""
    from torch.distributed.tensor import Replicate

    return [
        name for name, p in module.named_parameters()
        if is_dtensor(p) and not all(isinstance(pl, Replicate) for pl in p.placements)
    ]


def check_not_sharded_for_calibration(model: torch.nn.Module, transform: str) -> None:
    """Refuse to fuse a transform into a model whose parameters are sharded across processes."""
    if _dtensor_type() is None:
        return
    names = sharded_parameter_names(model)
    if names:
        raise ValueError(
            f"transform={transform!r} is fused into whole attention weights, but this model is sharded "
            f"across processes ({len(names)} parameters, e.g. {names[0]!r}, are DTensor shards); "
            + CALIBRATE_THEN_SHARD.format(transform=transform)
        )


def check_load_not_sharded_for_calibration(config, transform: str, calibrated: bool) -> None:
    """The same refusal before any weight is read, from the `distributed_config` that `from_pretrained` sets."""
    if transform == "none" or calibrated:
        return
    dist = getattr(config, "distributed_config", None)
    if dist is None:
        return
    sizes = {k: getattr(dist, k, None) or 1 for k in ("tp_size", "fsdp_size", "ep_size", "pp_size")}
    if getattr(dist, "tp_plan", None) is None and all(v == 1 for v in sizes.values()):
        return
    split = ", ".join([f"tp_plan={dist.tp_plan!r}"] + [f"{k}={v}" for k, v in sizes.items() if v != 1])
    raise ValueError(
        f"transform={transform!r} is fused into whole attention weights, but this checkpoint is being loaded split "
        f"across processes ({split}); " + CALIBRATE_THEN_SHARD.format(transform=transform)
    )


# ------------------------------------------------------------------------------------------------ shutdown
_RELEASES: list = []  # functions that drop captured CUDA graphs (`release_before_shutdown`)


def release_before_shutdown(release) -> None:
    """Call `release()` (a function that drops captured CUDA graphs) before any process group is destroyed and at
    interpreter exit (see the module docstring); registering the same function twice has no effect.

    Installs, once: an `atexit` hook, and a wrapper of `torch.distributed.destroy_process_group` that runs the
    releases first. A script that bound the stock function before (`from torch.distributed import
    destroy_process_group`) calls `quantmla_hf.generation.graphs.release_decode_graphs()` before it instead.
    """
    if release in _RELEASES:
        return
    if not _RELEASES:
        atexit.register(release_captured_graphs)
        if torch.distributed.is_available():
            _wrap_destroy_process_group()
    _RELEASES.append(release)


def release_captured_graphs() -> None:
    """Run every function registered with `release_before_shutdown`."""
    for release in list(_RELEASES):
        release()


def _wrap_destroy_process_group() -> None:
    c10d = torch.distributed.distributed_c10d
    stock = c10d.destroy_process_group
    if getattr(stock, "releases_captured_graphs", False):
        return

    @functools.wraps(stock)
    def destroy_process_group(*args, **kwargs):
        release_captured_graphs()
        return stock(*args, **kwargs)

    destroy_process_group.releases_captured_graphs = True
    c10d.destroy_process_group = destroy_process_group
    torch.distributed.destroy_process_group = destroy_process_group


def collective_backends(model: torch.nn.Module, device_type: str = "cuda") -> set[str]:
    """Backends ("nccl", "gloo", ...) of the process groups over which `model`'s DTensor parameters on `device_type`
    meshes are distributed (its tensor-parallel collectives): empty for a model in one process."""
    if _dtensor_type() is None or not torch.distributed.is_initialized():
        return set()
    meshes = {id(p.device_mesh): p.device_mesh for p in model.parameters()
              if is_dtensor(p) and p.device_mesh.device_type == device_type}
    return {str(torch.distributed.get_backend(mesh.get_group(dim)))
            for mesh in meshes.values() for dim in range(mesh.ndim)}


def uncapturable_collectives(backends: set[str]) -> str | None:
    """Why collectives over `backends` (`collective_backends` of a model on CUDA) cannot be captured in a CUDA graph,
    or None: NCCL's can; gloo moves CUDA tensors through the host, which a capture cannot do."""
    other = sorted(backends - {"nccl"})
    if other:
        return (
            f"the tensor-parallel collectives run over {', '.join(map(repr, other))}, which a CUDA graph cannot "
            "capture; initialise the process group with the 'nccl' backend for replayed decode steps"
        )
    return None
