"""Outputs are checked before the work, written beside the destination and moved in whole (CLI and save_pretrained);
a write the storage refuses is one line naming what to do, whichever writer failed; outputs get a plain mkdir's and
open's permissions.

Full disks are real where the test can mount a small tmpfs (root with `mount`, a container allowed to mount; the
tests say why they skip elsewhere); everywhere, a real file size limit (`ulimit -f`) makes safetensors' own writer
fail, and the weights writer is patched to fail as safetensors does on a full disk or quota (part of the file
written, then its own `SafetensorError`, which is not an `OSError`). The read-only case patches `os.access` (the
tests run as root, for whom chmod does not make a folder read-only).
"""

from __future__ import annotations

import errno
import gc
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading

import pytest
import torch
import transformers.modeling_utils
from safetensors import SafetensorError, safe_open
from transformers import AutoModelForCausalLM

import quantmla_hf.cli.main
import quantmla_hf.saving.hub
import quantmla_hf.saving.staged_output
from quantmla_hf import QuantMLAConfig, apply_quantmla
from quantmla_hf.calibration.checkpoint import CalibrationCheckpoint
from quantmla_hf.cli.main import main
from quantmla_hf.saving.staged_output import OutputError, staged_directory, write_text_atomic
from quantmla_hf.tiny_models import tiny_mla_model

try:
    import resource
except ImportError:  # Windows
    resource = None

FULL = "no space left on the device (ENOSPC); nothing was left half-written there. Free space or choose another " \
       "destination"


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("base")
    tiny_mla_model("deepseek_v3", seed=6).save_pretrained(path)
    return path


def quantize(base_dir, out, capsys, *extra):
    rc = main(["quantize", str(base_dir), "--out", str(out), "--transform", "none", "--group-size", "16", *extra])
    captured = capsys.readouterr()
    return rc, captured.err.strip(), captured.out


def no_loading(monkeypatch):
    """Make loading a model fail loudly: the check under test must come before it."""
    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the destination was checked")
    monkeypatch.setattr(quantmla_hf.cli.main.AutoModelForCausalLM, "from_pretrained", refuse)


def leftovers(folder):
    return [p.name for p in folder.parent.iterdir() if p.name.endswith(".partial")]


def test_existing_checkpoint_is_refused_before_loading_unless_overwrite(base_dir, tmp_path, capsys, monkeypatch):
    out = tmp_path / "q"
    assert quantize(base_dir, out, capsys)[0] == 0
    with monkeypatch.context() as m:
        no_loading(m)
        rc, err, stdout = quantize(base_dir, out, capsys, "--content-bits", "2")
    assert rc == 1 and "Traceback" not in err and "saved" not in stdout
    assert err == f"quantmla quantize: error: {out} already holds a checkpoint; pass --overwrite to replace it, or " \
                  "choose a new folder"
    assert quantize(base_dir, out, capsys, "--content-bits", "2", "--overwrite")[0] == 0
    assert json.loads((out / "config.json").read_text())["quantization_config"]["content_bits"] == 2


def read_only_folder(tmp_path, monkeypatch):
    """A folder the output checks see as read-only (`os.access` says so: the tests run as root, whom chmod does
    not stop)."""
    parent = tmp_path / "readonly"
    parent.mkdir()
    real_access = quantmla_hf.saving.staged_output.os.access
    monkeypatch.setattr(quantmla_hf.saving.staged_output.os, "access",
                        lambda p, mode: False if str(p) == str(parent) else real_access(p, mode))
    return parent


def test_read_only_destination_is_refused_before_loading(base_dir, tmp_path, capsys, monkeypatch):
    parent = read_only_folder(tmp_path, monkeypatch)
    no_loading(monkeypatch)
    rc, err, _ = quantize(base_dir, parent / "q", capsys)
    assert rc == 1 and len(err.splitlines()) == 1
    assert err.startswith(f"quantmla quantize: error: cannot write to {parent} (read-only or no permission)")


def test_file_as_destination_and_missing_model_path_are_one_line(base_dir, tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    rc, err, _ = quantize(base_dir, tmp_path / "file", capsys)
    assert rc == 1 and err == f"quantmla quantize: error: {tmp_path / 'file'} is a file, not a folder; choose a " \
                              "folder for the output"
    rc, err, _ = quantize(tmp_path / "no" / "such" / "model", tmp_path / "q", capsys)
    assert rc == 1 and "no such directory" in err and "Repo id" not in err and len(err.splitlines()) == 1


# What the weights writer raises on a full disk or an exhausted quota: safetensors' own error (its message format
# since 0.5 and before it) or an OSError.
STORAGE_FAILURES = {
    "safetensors ENOSPC": (SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)"),
                           "no space left on the device (ENOSPC)"),
    "safetensors EDQUOT": (SafetensorError('Error while serializing: IoError(Os { code: 122, kind: QuotaExceeded, '
                                           'message: "Disk quota exceeded" })'), "disk quota exceeded (EDQUOT)"),
    "OSError EDQUOT": (OSError(errno.EDQUOT, "Disk quota exceeded"), "disk quota exceeded (EDQUOT)"),
}


def failing_weights_writer(monkeypatch, error):
    """transformers' safetensors writer fails with `error` after writing part of the file, as a full disk makes it."""
    def write_part_then_fail(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"\0" * 100)
        raise error

    monkeypatch.setattr(transformers.modeling_utils, "safe_save_file", write_part_then_fail)


@pytest.mark.parametrize("failure", STORAGE_FAILURES)
def test_a_failed_weights_write_is_one_line_and_leaves_nothing(base_dir, tmp_path, capsys, monkeypatch, failure):
    error, reason = STORAGE_FAILURES[failure]
    failing_weights_writer(monkeypatch, error)
    out = tmp_path / "q"
    rc, err, stdout = quantize(base_dir, out, capsys)
    assert rc == 1 and "Traceback" not in err and "saved" not in stdout
    (line,) = [line for line in err.splitlines() if "error" in line]  # the rest is the progress bar
    assert line == f"quantmla quantize: error: could not write {out}: {reason}; nothing was left half-written " \
                   "there. Free space or choose another destination"
    assert not out.exists() and not leftovers(out)
    model = apply_quantmla(tiny_mla_model("deepseek_v3", seed=1), QuantMLAConfig(transform="none", group_size=16))
    with pytest.raises(OutputError) as failed:
        model.save_pretrained(tmp_path / "api")
    assert str(failed.value) == f"could not write {tmp_path / 'api'}: {reason}; nothing was left half-written " \
                                "there. Free space or choose another destination"
    assert not (tmp_path / "api").exists() and not leftovers(tmp_path / "api")


def test_a_failed_weights_write_keeps_an_existing_checkpoint_whole(base_dir, tmp_path, capsys, monkeypatch):
    out = tmp_path / "q"
    assert quantize(base_dir, out, capsys)[0] == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    failing_weights_writer(monkeypatch, STORAGE_FAILURES["safetensors ENOSPC"][0])
    assert quantize(base_dir, out, capsys, "--content-bits", "2", "--overwrite")[0] == 1
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before and not leftovers(out)


def test_an_error_that_is_not_the_storages_passes_through(tmp_path):
    """A tensor safetensors cannot serialize is a bug to see whole, not a disk to free."""
    with pytest.raises(SafetensorError, match="InvalidTensorView"):
        with staged_directory(tmp_path / "q") as staged:
            (staged.path / "config.json").write_text("{}")
            raise SafetensorError("Error while serializing: InvalidTensorView(BF16, [2], 3)")
    assert not (tmp_path / "q").exists() and not leftovers(tmp_path / "q")


@pytest.fixture
def small_disk(tmp_path):
    """A 1 MiB tmpfs mounted at tmp_path/disk (unmounted after the test); skips, saying why, where none can be."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if not sys.platform.startswith("linux"):
        pytest.skip(f"a real full disk needs a Linux tmpfs; this is {sys.platform}")
    if os.geteuid() != 0:
        pytest.skip(f"mounting a tmpfs for a real full disk needs root; running as uid {os.geteuid()}")
    if shutil.which("mount") is None or shutil.which("umount") is None:
        pytest.skip("mounting a tmpfs for a real full disk needs the mount and umount commands; not installed")
    run = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(disk)], capture_output=True, text=True)
    if run.returncode != 0:
        pytest.skip("could not mount a tmpfs for a real full disk (a container without CAP_SYS_ADMIN cannot): "
                    + (run.stderr.strip() or f"mount exited {run.returncode}"))
    try:
        yield disk
    finally:
        gc.collect()  # a failed writer's file objects, still held by reference cycles, keep the mount busy
        if subprocess.run(["umount", str(disk)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "--lazy", str(disk)], check=True)  # still busy (a failed test's traceback)


def fill(disk, leave: int) -> int:
    """Fill `disk` until `leave` bytes are free; returns the free bytes left (tmpfs counts whole pages)."""
    free = shutil.disk_usage(disk).free
    with open(disk / "filler", "ab") as f:
        f.write(b"\0" * max(free - leave, 0))
    return shutil.disk_usage(disk).free


@pytest.mark.parametrize("leave", [0, 200 * 1024], ids=["config.json fails", "weights fail"])
def test_real_full_disk_quantize_is_one_line_and_leaves_nothing(base_dir, small_disk, capsys, leave):
    """Nothing left (config.json's OSError) or room for the config but not the weights (safetensors' own error)."""
    free = fill(small_disk, leave)
    out = small_disk / "q"
    rc, err, stdout = quantize(base_dir, out, capsys)
    assert rc == 1 and "Traceback" not in err and "saved" not in stdout
    (line,) = [line for line in err.splitlines() if "error" in line]
    assert line == f"quantmla quantize: error: could not write {out}: {FULL}"
    assert sorted(p.name for p in small_disk.iterdir()) == ["filler"] and shutil.disk_usage(small_disk).free == free


def test_real_full_disk_keeps_an_existing_checkpoint_whole(base_dir, small_disk, capsys):
    out = small_disk / "q"
    assert quantize(base_dir, out, capsys)[0] == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    fill(small_disk, 64 * 1024)
    rc, err, _ = quantize(base_dir, out, capsys, "--content-bits", "2", "--overwrite")
    assert rc == 1 and err.splitlines()[-1] == f"quantmla quantize: error: could not write {out}: {FULL}"
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in small_disk.iterdir()) == ["filler", "q"]


def test_real_full_disk_text_calibration_checkpoint_and_push_folder(small_disk, monkeypatch):
    """The other writers on a full disk: `--json`'s text (the old file kept), a calibration checkpoint layer
    (torch.save's RuntimeError, its temporary file removed, finished layers kept) and the folder `push_to_hub`
    stages in the temporary directory (nothing uploaded)."""
    report = write_text_atomic(small_disk / "r.json", "{}\n")
    checkpoint = CalibrationCheckpoint(small_disk / "ckpt", {"model": "tiny"})
    checkpoint.save(0, [{"scale": torch.ones(4)}])
    layer0 = (small_disk / "ckpt" / "layer_00000.pt").read_bytes()
    fill(small_disk, 0)

    with pytest.raises(OutputError) as failed:
        write_text_atomic(report, "x" * 100_000)
    assert str(failed.value) == f"could not write {report}: {FULL}"
    assert report.read_text() == "{}\n"

    with pytest.raises(OutputError) as failed:
        checkpoint.save(1, [{"rotation": torch.ones(512, 512)}])
    assert str(failed.value) == f"could not write {small_disk / 'ckpt' / 'layer_00001.pt'}: {FULL}"
    assert sorted(p.name for p in (small_disk / "ckpt").iterdir()) == ["layer_00000.pt", "manifest.json"]
    assert (small_disk / "ckpt" / "layer_00000.pt").read_bytes() == layer0 and checkpoint.finished() == 1

    class NoHub:  # the Hub is not what is tested: the push must fail before reaching it
        def __init__(self, token=None):
            pass

        def create_repo(self, repo_id, **kwargs):
            return type("RepoUrl", (), {"repo_id": repo_id})()

        def upload_folder(self, **kwargs):
            raise AssertionError("a push whose files could not be written uploaded them")

    monkeypatch.setattr(quantmla_hf.saving.hub, "HfApi", NoHub)
    monkeypatch.setattr(tempfile, "tempdir", str(small_disk))
    model = apply_quantmla(tiny_mla_model("deepseek_v3", seed=1), QuantMLAConfig(transform="none", group_size=16))
    with pytest.raises(OutputError, match=r"no space left on the device \(ENOSPC\); nothing was left half-written "
                                          r"there. Free space there or set TMPDIR to another folder$"):
        model.push_to_hub("tester/full")
    assert sorted(p.name for p in small_disk.iterdir()) == ["ckpt", "filler", "r.json"]


@pytest.mark.skipif(resource is None, reason="no file size limit to set here (Python's resource module is Unix-only)")
def test_real_file_size_limit_is_one_line_and_leaves_nothing(base_dir, tmp_path):
    """A real refusal of the write anywhere, root or not: the file size limit (`ulimit -f`, SIGXFSZ ignored as
    shells leave it for a limited job) makes safetensors' writer fail with EFBIG inside its own error."""
    def limit_file_size():
        resource.setrlimit(resource.RLIMIT_FSIZE, (200 * 1024, 200 * 1024))
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)

    out = tmp_path / "q"
    run = subprocess.run([sys.executable, "-m", "quantmla_hf.cli.main", "quantize", str(base_dir), "--out", str(out),
                          "--transform", "none", "--group-size", "16"], cwd=tmp_path, capture_output=True,
                         text=True, timeout=600, preexec_fn=limit_file_size)
    assert run.returncode == 1 and "Traceback" not in run.stderr and "saved" not in run.stdout
    assert run.stderr.splitlines()[-1] == (
        f"quantmla quantize: error: could not write {out}: file too large for the file system or the process's file "
        "size limit (EFBIG); nothing was left half-written there. Choose another destination or raise the file size "
        "limit (ulimit -f)")
    assert not out.exists() and not leftovers(out)


@pytest.mark.parametrize("umask", [0o022, 0o027], ids=["umask 022", "umask 027"])
def test_outputs_get_a_plain_mkdirs_and_opens_permissions(base_dir, tmp_path, capsys, umask):
    """Folders 0o777 & ~umask and files 0o666 & ~umask, as transformers' save_pretrained gives (safetensors >= 0.8
    itself writes 0600); missing parents are created the same way; a replaced file keeps its own bits."""
    old = os.umask(umask)
    try:
        out = tmp_path / "new" / "parents" / "q"
        assert quantize(base_dir, out, capsys)[0] == 0
        report = write_text_atomic(tmp_path / "reports" / "r.json", "{}\n")
        (out / "config.json").chmod(0o600)
        assert quantize(base_dir, out, capsys, "--content-bits", "2", "--overwrite")[0] == 0
    finally:
        os.umask(old)
    mode = {p.relative_to(tmp_path).as_posix(): stat.S_IMODE(p.stat().st_mode) for p in tmp_path.rglob("*")}
    folders, files = 0o777 & ~umask, 0o666 & ~umask
    assert mode == {"new": folders, "new/parents": folders, "new/parents/q": folders, "reports": folders,
                    "reports/r.json": files, "new/parents/q/config.json": 0o600,
                    **{f"new/parents/q/{name}": files for name in ("README.md", "generation_config.json",
                                                                   "model.safetensors")}}
    assert json.loads((out / "config.json").read_text())["quantization_config"]["content_bits"] == 2


def test_a_destination_under_a_file_is_one_line(base_dir, tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    out = tmp_path / "file" / "q"
    rc, err, _ = quantize(base_dir, out, capsys)
    assert rc == 1 and err == f"quantmla quantize: error: cannot create {out}: {tmp_path / 'file'} is a file, not " \
                              "a folder; choose another location"


def _writers(monkeypatch):
    """Two differently quantized models whose saves are both past the destination check before either finishes."""
    barrier = threading.Barrier(2, timeout=30)
    real_card = quantmla_hf.saving.hub.write_model_card

    def card_after_both_started(*args, **kwargs):
        barrier.wait()
        return real_card(*args, **kwargs)

    monkeypatch.setattr(quantmla_hf.saving.hub, "write_model_card", card_after_both_started)
    return [apply_quantmla(tiny_mla_model("deepseek_v3", seed=s), QuantMLAConfig(transform="none", group_size=16,
                                                                                 content_bits=b))
            for s, b in ((1, 4), (2, 2))]


def _save_concurrently(models, out, **kwargs):
    results = [None, None]

    def save(i):
        try:
            models[i].save_pretrained(out, **kwargs)
            results[i] = "saved"
        except OutputError as err:
            results[i] = str(err)

    threads = [threading.Thread(target=save, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def _consistent(models, out) -> int:
    """The index of the model whose config, card and weights are all in `out` (fails on a mix)."""
    bits = json.loads((out / "config.json").read_text())["quantization_config"]["content_bits"]
    (i,) = [i for i, m in enumerate(models) if m.config.quantization_config.content_bits == bits]
    assert f"C{bits}R4" in (out / "README.md").read_text()
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        name = next(iter(f.keys()))
        assert f.get_tensor(name).equal(models[i].state_dict()[name])
    return i


def test_two_concurrent_writers_one_wins_the_other_is_told(tmp_path, monkeypatch):
    models = _writers(monkeypatch)
    out = tmp_path / "q"
    results = _save_concurrently(models, out, overwrite=False)
    assert sorted(r == "saved" for r in results) == [False, True], results
    loser = results.index(next(r for r in results if r != "saved"))
    assert "already holds a checkpoint" in results[loser]
    assert _consistent(models, out) == 1 - loser and not leftovers(out)


def test_two_concurrent_overwriting_writers_leave_one_whole_checkpoint(tmp_path, monkeypatch):
    models = _writers(monkeypatch)
    out = tmp_path / "q"
    assert _save_concurrently(models, out, overwrite=True) == ["saved", "saved"]
    _consistent(models, out)
    assert not leftovers(out)
    assert AutoModelForCausalLM.from_pretrained(out).config.quantization_config.transform == "none"


def test_save_pretrained_replaces_a_checkpoint_as_transformers_does_or_refuses_when_asked(tmp_path):
    model = apply_quantmla(tiny_mla_model("deepseek_v3", seed=1), QuantMLAConfig(transform="none", group_size=16))
    model.save_pretrained(tmp_path / "q")
    with pytest.raises(OutputError, match="pass overwrite=True"):
        model.save_pretrained(tmp_path / "q", overwrite=False)
    (tmp_path / "q" / "model-00001-of-00002.safetensors").write_bytes(b"a stale shard of an older save")
    model.save_pretrained(tmp_path / "q")
    assert not (tmp_path / "q" / "model-00001-of-00002.safetensors").exists()  # no stale shard beside the new one


def test_eval_json_destination_is_checked_before_the_evaluation(base_dir, tmp_path, capsys, monkeypatch):
    from quantmla_hf.embedded import EVALUATION_TEXT

    parent = read_only_folder(tmp_path, monkeypatch)
    no_loading(monkeypatch)
    rc = main(["eval", str(base_dir), "--text", str(EVALUATION_TEXT), "--json", str(parent / "r.json")])
    err = capsys.readouterr().err.strip()
    assert rc == 1 and err == f"quantmla eval: error: cannot write to {parent} (read-only or no permission); " \
                              "choose a writable folder"
