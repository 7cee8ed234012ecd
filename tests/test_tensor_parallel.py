"""Tensor parallel and offloaded (device-map) weights with the QuantMLA cache, on the CPU.

transformers' tensor parallel runs on the CPU with the gloo backend (`DISTRIBUTED_BACKEND_MAP["cpu"] == "gloo"`
in 5.17 and 5.24), so these tests run the real thing: two spawned processes load tiny checkpoints of every MLA
family with `tp_plan="auto"` (or `distributed_config=DistributedConfig(tp_plan="auto")`), which shards q_proj /
q_b_proj and kv_b_proj by heads and o_proj by rows where the family's plan says so, and generate greedily with the
native latent decode. Each rank's logits must match one process's within float32 reduction-order noise.
"""

from __future__ import annotations

import os
import socket
from unittest import mock

import pytest
import torch
import torch.multiprocessing as mp
from transformers import AutoModelForCausalLM

from quantmla_hf import QuantMLAConfig, apply_quantmla, mla_dims
from quantmla_hf.distributed import kv_b_weight, local_rows
from quantmla_hf.hooks import mla_attention_modules
from quantmla_hf.tiny_models import tiny_mla_model

FAMILIES = ("deepseek_v2", "deepseek_v3", "glm4_moe_lite", "longcat_flash", "minicpm3")
# Families whose plan shards attention (q/kv_b colwise, o_proj rowwise) in transformers 5.24.
SHARDS_ATTENTION = ("deepseek_v2", "glm4_moe_lite", "longcat_flash", "minicpm3")
WORLD = 2
NEW_TOKENS = 6


def qconfig(bits: int, **kw) -> QuantMLAConfig:
    """Windows small enough that decode steps read history from the packed planes (not only BF16 copies)."""
    base = dict(content_bits=bits, rope_bits=bits, transform="none", group_size=16, sink_tokens=2, recent_tokens=16)
    return QuantMLAConfig(**{**base, **kw})


def prompts() -> tuple[torch.Tensor, torch.Tensor]:
    """Batch 2, left padded: 27 and 21 real tokens (the prefill takes the SDPA path, decode the native one)."""
    ids = torch.randint(2, 128, (2, 27), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[1, :6] = 0
    ids[1, :6] = 0
    return ids, mask


def greedy(model) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy tokens `[2, NEW_TOKENS]` and logits `[NEW_TOKENS, 2, V]` of `model` on `prompts()`."""
    ids, mask = prompts()
    out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0,
                         return_dict_in_generate=True, output_logits=True)
    return out.sequences[:, ids.shape[1]:], torch.stack(out.logits).float()


def cases(paths: dict) -> list[tuple[str, str, int, str]]:
    """(name, checkpoint, bits, form of the TP argument): every family at C4R4, the BF16-latent layout C16R16 once,
    and both forms of the TP argument (`tp_plan` of 5.17, `distributed_config` of later releases)."""
    out = [(f"{family}-C4R4", paths[family], 4, "tp_plan") for family in FAMILIES]
    out.append(("deepseek_v2-C16R16", paths["deepseek_v2"], 16, "distributed_config"))
    out.append(("glm4_moe_lite-C4R4-distributed_config", paths["glm4_moe_lite"], 4, "distributed_config"))
    return out


def _tp_kwargs(form: str) -> dict:
    if form == "tp_plan":
        return {"tp_plan": "auto"}
    from transformers.distributed import DistributedConfig

    return {"distributed_config": DistributedConfig(tp_plan="auto")}


def _worker(rank: int, port: int, paths: dict, fused: str, out_dir: str) -> None:
    """One tensor-parallel rank: load every case with TP, generate, save tokens/logits; check the refusals."""
    import warnings

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(WORLD))
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        results, sharded = {}, {}
        for name, path, bits, form in cases(paths):
            model = AutoModelForCausalLM.from_pretrained(path, quantization_config=qconfig(bits), **_tp_kwargs(form))
            if name.split("-")[0] in SHARDS_ATTENTION:
                heads = mla_dims(model.config).num_heads // WORLD
                sharded[name] = tuple(kv_b_weight(mla_attention_modules(model)[0], heads, torch.device("cpu")).shape)
            results[name] = greedy(model)
        model = AutoModelForCausalLM.from_pretrained(fused, tp_plan="auto")  # calibrated in one process, saved
        results["fused"] = greedy(model)

        # Fusing a transform into sharded weights is refused, before loading and on a loaded model.
        errors = {}
        learned = qconfig(4, transform="learned", calibration_data=["text to calibrate on"])
        try:
            AutoModelForCausalLM.from_pretrained(paths["deepseek_v2"], tp_plan="auto", quantization_config=learned)
        except ValueError as err:
            errors["load"] = str(err)
        try:  # `model`: the fused deepseek_v2 checkpoint, sharded
            apply_quantmla(model, qconfig(4, transform="hadamard"))
        except ValueError as err:
            errors["apply"] = str(err)
        torch.save({"results": results, "sharded": sharded, "errors": errors}, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def tp_run(tmp_path_factory):
    """Checkpoints, one-process references, and the outputs of both ranks of a 2-process gloo TP run."""
    root = tmp_path_factory.mktemp("tp")
    paths = {}
    for family in FAMILIES:
        paths[family] = str(root / family)
        tiny_mla_model(family, seed=2).save_pretrained(paths[family])
    # The calibrate-then-shard path: learned transform fused in one process, saved, later loaded with TP.
    fused = str(root / "fused")
    calibration_ids = torch.randint(2, 128, (4, 32), generator=torch.Generator().manual_seed(0))
    model = apply_quantmla(AutoModelForCausalLM.from_pretrained(paths["deepseek_v2"]),
                           qconfig(4, transform="learned", calibration_steps=4), calibration_data=calibration_ids)
    model.save_pretrained(fused)
    references = {name: greedy(AutoModelForCausalLM.from_pretrained(path, quantization_config=qconfig(bits)))
                  for name, path, bits, _ in cases(paths)}
    references["fused"] = greedy(AutoModelForCausalLM.from_pretrained(fused))
    # fork: the ranks start with torch and transformers already imported (spawn re-imports them, ~5-20 s each).
    # Where a GPU is, spawn with the GPU hidden: a forked child cannot use CUDA once this process has, and
    # transformers' tensor parallel takes a visible GPU; these ranks run on the CPU either way.
    gpu = torch.cuda.is_available()
    with mock.patch.dict(os.environ, {"CUDA_VISIBLE_DEVICES": ""} if gpu else {}):
        mp.start_processes(_worker, args=(_free_port(), paths, fused, str(root)), nprocs=WORLD, join=True,
                           start_method="spawn" if gpu else "fork")
    ranks = [torch.load(root / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]
    return references, ranks


@pytest.mark.parametrize("rank", range(WORLD))
def test_tensor_parallel_generate_matches_one_process(tp_run, rank):
    references, ranks = tp_run
    got = ranks[rank]
    assert set(got["results"]) == set(references)
    for name, (tokens, logits) in references.items():
        tp_tokens, tp_logits = got["results"][name]
        # The row-parallel o_proj sums heads in another order: float32 noise, far below any 4-bit step.
        err = (tp_logits - logits).abs().max() / logits.abs().max()
        assert err < 1e-4, f"{name} rank {rank}: logits differ by {err:.2e} relative"
        assert torch.equal(tp_tokens, tokens), f"{name} rank {rank}: greedy tokens differ"


def test_sharded_plans_give_each_rank_its_heads_rows_of_kv_b(tp_run):
    """Where the plan shards attention, the decode absorbs H/2 heads' rows of kv_b_proj: [H/2 * (nope + v), d_c]."""
    _, ranks = tp_run
    for name, shape in ranks[0]["sharded"].items():
        if name.split("-")[0] in SHARDS_ATTENTION:
            assert shape == (4 // WORLD * (16 + 16), 64), f"{name}: local kv_b_proj {shape}"


def test_calibration_on_sharded_model_is_refused_with_what_to_do(tp_run):
    _, ranks = tp_run
    for got in ranks:
        assert set(got["errors"]) == {"load", "apply"}
        for err in got["errors"].values():
            assert "calibrate in one process" in err and "save_pretrained" in err and "tensor parallel" in err
        assert "tp_plan='auto'" in got["errors"]["load"]
        assert "DTensor" in got["errors"]["apply"]


def test_local_rows_refuses_a_kv_b_split_along_its_input(tmp_path):
    """A plan sharding kv_b_proj along d_c (rowwise) cannot serve the latent decode: a clear error, not wrong math."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        w = torch.randn(8, 6)
        assert torch.equal(local_rows(distribute_tensor(w, mesh, [Shard(0)]), "w"), w)
        assert torch.equal(local_rows(distribute_tensor(w, mesh, [Replicate()]), "w"), w)
        with pytest.raises(ValueError, match="colwise"):
            local_rows(distribute_tensor(w, mesh, [Shard(1)]), "kv_b_proj")
    finally:
        dist.destroy_process_group()


def test_device_map_with_a_layer_on_disk_decodes_like_one_device(tmp_path):
    """accelerate keeps an offloaded layer's weights on `meta` outside each submodule's own forward; the native
    decode loads kv_b_proj from the offload map onto the layer's execution device (bit-identical result)."""
    path = str(tmp_path / "ckpt")
    tiny_mla_model("deepseek_v2", seed=4).save_pretrained(path)
    tokens, logits = greedy(AutoModelForCausalLM.from_pretrained(path, quantization_config=qconfig(4)))
    device_map = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.layers.0": "cpu",
                  "model.layers.1": "disk", "model.norm": "cpu", "lm_head": "cpu"}
    model = AutoModelForCausalLM.from_pretrained(path, quantization_config=qconfig(4), device_map=device_map,
                                                 offload_folder=str(tmp_path / "offload"))
    assert [m.kv_b_proj.weight.device.type for m in mla_attention_modules(model)] == ["cpu", "meta"]
    off_tokens, off_logits = greedy(model)
    assert torch.equal(off_tokens, tokens)
    assert torch.equal(off_logits, logits)
