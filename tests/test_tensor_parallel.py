"""Tensor parallel and offloaded (device-map) weights with the QuantMLA cache, on the CPU.

transformers' tensor parallel runs on the CPU with the gloo backend (`DISTRIBUTED_BACKEND_MAP["cpu"] == "gloo"`
in 5.17 and 5.24), so these tests run the real thing: two spawned processes load tiny checkpoints of every MLA
family with `tp_plan="auto"` (or `distributed_config=DistributedConfig(tp_plan="auto")`), which shards q_proj /
q_b_proj and kv_b_proj by heads and o_proj by rows where the family's plan says so, and generate greedily with the
native latent decode. Each rank's logits must match one process's within float32 reduction-order noise.

Processes that exit: `torchrun` runs this file as a script (`_exit_check`, at the bottom) in two ranks that generate
through the replayed-step path (on the CPU the captured steps are replayed by `test_decode_graphs.HostReplayStep`;
with two GPUs, CUDA graphs holding NCCL all-reduces), then end with `destroy_process_group`, without it, or
interrupted in the middle of a `generate`. The test fails, killing them, when the launcher has not exited
`EXIT_WITHIN` seconds after the ranks' last `generate`, and checks that the captured steps were released before the
process group went away.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.multiprocessing as mp
from transformers import AutoModelForCausalLM

import quantmla_hf.generation.graphs as dg
from quantmla_hf import QuantMLAConfig, StaticQuantMLACache, apply_quantmla, mla_dims
from quantmla_hf.attention.state import mla_attention_modules
from quantmla_hf.distributed import collective_backends, kv_b_weight, local_rows, uncapturable_collectives
from quantmla_hf.integration import generated_cache
from quantmla_hf.tiny_models import tiny_config, tiny_mla_model

FAMILIES = ("deepseek_v2", "deepseek_v3", "glm4_moe_lite", "longcat_flash", "minicpm3")

def shards_attention(family: str) -> bool:
    """Whether the installed transformers' tensor-parallel plan for `family` splits attention (kv_b_proj column-wise):
    every family's from 5.25 on, all but deepseek_v3's (which splits only the MLP) before."""
    plan = tiny_config(family).base_model_tp_plan or {}
    return any(key.endswith("kv_b_proj") and style == "colwise" for key, style in plan.items())


SHARDS_ATTENTION = tuple(f for f in FAMILIES if shards_attention(f))
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
                           qconfig(4, transform="learned", advanced={"calibration_steps": 4}),
                           calibration_data=calibration_ids)
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


# ------------------------------------------------------------------------------------------------ processes exit
EXIT_WITHIN = 10.0  # seconds from the ranks' last generate to the launcher's exit
START_WITHIN = 300.0  # seconds for both ranks to import, load and reach their last generate (a loaded 2-core CPU)
ENDINGS = ("destroy", "exit", "interrupt")


def _write(path: Path, text: str) -> None:
    part = path.with_suffix(".part")
    part.write_text(text)
    os.replace(part, path)  # the parent polls: never a half-written file


class _InterruptAt:
    """A streamer that interrupts `generate` (KeyboardInterrupt, as Ctrl-C) when its `n`-th chunk arrives."""

    def __init__(self, n: int, on_interrupt):
        self.n, self.on_interrupt, self.seen = n, on_interrupt, 0

    def put(self, value):
        self.seen += 1
        if self.seen == self.n:
            self.on_interrupt()
            raise KeyboardInterrupt

    def end(self):
        pass


def _exit_check(ckpt: str, out: str, ending: str, backend: str) -> None:
    """One rank under torchrun: a tensor-parallel model generates eagerly, then through the replayed-step path
    (same tokens), then ends as `ending` says ("destroy": destroy_process_group; "exit": returns with the process
    group transformers created still alive; "interrupt": a generate interrupted by KeyboardInterrupt, uncaught).
    Writes `mark{rank}` (time of the last generate) and `rank{rank}.json` (what it saw, the last part at exit)."""
    import atexit
    import types

    import torch.distributed as dist

    rank, out = int(os.environ["RANK"]), Path(out)
    _write(out / f"pid{rank}", str(os.getpid()))  # torchrun starts each rank in a session of its own
    torch.set_num_threads(1)
    seen = {}
    held = []  # the cache of the replayed generation

    def at_exit():  # registered before any capture: runs after the library's own exit hook (atexit is LIFO)
        seen["held_at_exit"] = dg.graph_bytes(held[0]) if held else None
        _write(out / f"rank{rank}.json", json.dumps(seen))

    atexit.register(at_exit)
    model = AutoModelForCausalLM.from_pretrained(ckpt, quantization_config=qconfig(4), tp_plan="auto")
    ids, mask = (t.to(model.device) for t in prompts())
    gen = dict(attention_mask=mask, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
               pad_token_id=0)
    eager = model.generate(ids, **gen, disable_compile=True)
    if backend == "gloo":  # the CPU: captured steps replayed by running the recorded forward again
        from test_decode_graphs import HostReplayStep

        dg.DecodeGraphStep = HostReplayStep
        model.hf_device_map = {"": 0}
        model._valid_auto_compile_criteria = types.MethodType(lambda self, kw, config: not config.disable_compile,
                                                              model)
    replayed = model.generate(ids, **gen, return_dict_in_generate=True)
    held.append(generated_cache(replayed))
    stats = dg.graph_stats(model)
    seen.update(tokens_equal=torch.equal(replayed.sequences, eager), captures=stats.captures, replays=stats.replays,
                held_after_generate=dg.graph_bytes(held[0]))
    if ending == "interrupt":
        model.generate(ids, **gen, streamer=_InterruptAt(4, lambda: _write(out / f"mark{rank}", str(time.time()))))
    _write(out / f"mark{rank}", str(time.time()))
    if ending == "destroy":
        dist.destroy_process_group()
        seen["held_after_destroy"] = dg.graph_bytes(held[0])
        seen["pooled_after_destroy"] = len(dg.cache_pool(model))


def _run_ranks(ckpt: str, out: Path, ending: str, backend: str) -> tuple[int, float, str]:
    """Launch `_exit_check` in two ranks with torchrun; returns (exit status, seconds from the later rank's last
    generate to the launcher's exit, the log). Fails, killing the ranks, past `EXIT_WITHIN` / `START_WITHIN`."""
    out.mkdir()
    log_path = out / "log.txt"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(WORLD),
           "--monitor-interval", "0.2", __file__, ckpt, str(out), ending, backend]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=out, start_new_session=True)
    start, marks = time.time(), []
    try:
        while proc.poll() is None:
            marks = [float((out / f"mark{r}").read_text()) for r in range(WORLD) if (out / f"mark{r}").exists()]
            now = time.time()
            if len(marks) == WORLD and now > max(marks) + EXIT_WITHIN:
                pytest.fail(f"{ending}/{backend}: the ranks did not exit within {EXIT_WITHIN:.0f} s of their last "
                            f"generate; log:\n{log_path.read_text()[-3000:]}")
            if len(marks) < WORLD and now > start + START_WITHIN:
                pytest.fail(f"{ending}/{backend}: the ranks did not reach their last generate within "
                            f"{START_WITHIN:.0f} s; log:\n{log_path.read_text()[-3000:]}")
            time.sleep(0.1)
        exited = time.time()
    finally:
        _kill(proc, out)
    marks = [float((out / f"mark{r}").read_text()) for r in range(WORLD) if (out / f"mark{r}").exists()]
    assert len(marks) == WORLD, f"{ending}/{backend}: a rank ended before its last generate:\n{log_path.read_text()}"
    return proc.returncode, exited - max(marks), log_path.read_text()


def _kill(proc: subprocess.Popen, out: Path) -> None:
    """Stop the launcher and the ranks it started (each in a session of its own), if still running."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    for r in range(WORLD):
        pid_file = out / f"pid{r}"
        if pid_file.exists():
            try:
                os.kill(int(pid_file.read_text()), signal.SIGKILL)
            except ProcessLookupError:
                pass  # exited


def test_release_drops_captured_steps_and_pooled_caches():
    """What runs before a process group is destroyed: a model's pooled caches lose their captured steps and leave
    its pool; without a model, every cache holding captured steps loses them."""
    models = [apply_quantmla(tiny_mla_model("deepseek_v3", seed=s), qconfig(4)) for s in (0, 1)]
    pooled = [StaticQuantMLACache(config=m.config, max_cache_len=64) for m in models]
    held = StaticQuantMLACache(config=models[0].config, max_cache_len=64)  # e.g. returned by generate to its caller
    for model, cache in zip(models, pooled):
        dg.cache_pool(model).put("key", cache, 10)
    for cache in (*pooled, held):
        dg.graphs_of(cache).put("step", object(), 100)
    assert dg.release_decode_graphs(models[0]) == 1
    assert len(dg.cache_pool(models[0])) == 0 and dg.graph_bytes(pooled[0]) == 0
    assert dg.graph_bytes(pooled[1]) == 100 and dg.graph_bytes(held) == 100 and len(dg.cache_pool(models[1])) == 1
    assert dg.release_decode_graphs() >= 2
    assert dg.graph_bytes(pooled[1]) == 0 and dg.graph_bytes(held) == 0 and len(dg.cache_pool(models[1])) == 0


def test_collectives_over_gloo_are_not_captured(tmp_path):
    """The backends of a model's tensor-parallel collectives come from its DTensor parameters' meshes; a CUDA
    model's over gloo (through the host) decode eagerly, saying why, NCCL's are captured."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    linear = torch.nn.Linear(6, 8)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        linear.weight = torch.nn.Parameter(distribute_tensor(linear.weight.detach(), mesh, [Shard(0)]))
        assert collective_backends(linear, "cpu") == {"gloo"}
        assert collective_backends(linear) == set()  # none on a CUDA mesh
    finally:
        dist.destroy_process_group()
    assert collective_backends(torch.nn.Linear(6, 8), "cpu") == set()
    why = uncapturable_collectives({"gloo"})
    assert "'gloo'" in why and "a CUDA graph cannot capture" in why and "'nccl'" in why
    assert uncapturable_collectives({"nccl"}) is None and uncapturable_collectives(set()) is None


@pytest.fixture(scope="module")
def exit_checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("exit") / "deepseek_v2"
    tiny_mla_model("deepseek_v2", seed=2).save_pretrained(path)
    return str(path)


GLOO_FINALIZATION_ABORT = "terminate called without an active exception"


def _gloo_finalization_abort(backend: str, log: str, out: Path) -> bool:
    """Whether a nonzero exit is torch's own race at interpreter finalization over gloo, and nothing of ours.

    The C++ process groups and their `pt_gloo_runloop` threads outlive `destroy_process_group` and the script's return
    (sharding results that torch's DTensor dispatch keeps still refer to the model's device meshes). A gloo worker
    thread that drops the last reference to a tensor after finalization has begun takes the GIL, and Python ends that
    thread with a forced unwind, which aborts the process with this message
    (https://github.com/pytorch/pytorch/issues/190489); the launcher then stops the other ranks with SIGTERM. It
    strikes rarely, only after the `atexit` hooks have run, so it is accepted only for gloo, with that message, when
    some rank wrote what it saw at exit (the library's exit hook had released the captured steps) and every other rank
    either wrote it too or was stopped by the launcher; the assertions on the files written still apply."""
    if backend != "gloo" or GLOO_FINALIZATION_ABORT not in log:
        return False
    wrote = [(out / f"rank{rank}.json").exists() for rank in range(WORLD)]
    stopped = [f"Sending process {(out / f'pid{rank}').read_text()} closing signal SIGTERM" in log
               for rank in range(WORLD)]
    return any(wrote) and all(w or s for w, s in zip(wrote, stopped))


def _backends():
    nccl = pytest.mark.skipif(torch.cuda.device_count() < WORLD, reason=f"NCCL needs {WORLD} GPUs")
    return [pytest.param("gloo", id="gloo"), pytest.param("nccl", id="nccl", marks=nccl)]


@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize("ending", ENDINGS)
def test_tensor_parallel_processes_exit_after_generate(exit_checkpoint, tmp_path, ending, backend):
    """Every rank exits within EXIT_WITHIN seconds of its last generate: after destroy_process_group, without it
    (transformers created the process group), and interrupted in the middle of a generate; the replayed steps gave
    the eager tokens, and their captured steps were released before the process group went away."""
    status, after, log = _run_ranks(exit_checkpoint, tmp_path / "run", ending, backend)
    assert after <= EXIT_WITHIN
    if ending == "interrupt":
        assert status != 0 and "KeyboardInterrupt" in log
    else:
        assert status == 0 or _gloo_finalization_abort(backend, log, tmp_path / "run"), log[-3000:]
    ranks = range(WORLD) if status == 0 or ending == "interrupt" else [
        rank for rank in range(WORLD) if (tmp_path / "run" / f"rank{rank}.json").exists()]
    for rank in ranks:
        seen = json.loads((tmp_path / "run" / f"rank{rank}.json").read_text())
        assert seen["tokens_equal"] and seen["captures"] >= 1 and seen["replays"] >= NEW_TOKENS - 1, seen
        assert seen["held_after_generate"] > 0, seen  # the model keeps its cache and captured steps for later calls
        assert seen["held_at_exit"] == 0, seen
        if ending == "destroy":
            assert seen["held_after_destroy"] == 0 and seen["pooled_after_destroy"] == 0, seen


if __name__ == "__main__":  # a rank of `_run_ranks`
    _exit_check(*sys.argv[1:])
