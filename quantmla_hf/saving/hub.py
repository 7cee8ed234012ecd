"""`save_pretrained` and `push_to_hub` of a QuantMLA model: transformers' own, written atomically, with the QuantMLA
model card, uploading exactly the files a save wrote (`hooks.QuantMLAModel` calls these)."""

from __future__ import annotations

import os
import tempfile

from huggingface_hub import CommitOperationAdd, HfApi

from .model_card import has_own_card, write_model_card
from .staged_output import staged_directory, write_errors

# `save_pretrained(..., push_to_hub=True, **kwargs)` arguments that go to the Hub upload, not to the save.
HUB_SAVE_KWARGS = ("repo_id", "commit_message", "commit_description", "private", "create_pr", "revision")


def upload_saved_files(api: HfApi, repo_id: str, folder, files: list[str], commit_message: str, **commit_kwargs):
    """One commit to `repo_id` of exactly `files` (paths relative to `folder`, as `StagedOutput.files` lists what a
    save wrote); other files in `folder` are never read. Returns huggingface_hub's `CommitInfo`."""
    operations = [CommitOperationAdd(path_in_repo=rel, path_or_fileobj=os.path.join(folder, rel)) for rel in files]
    return api.create_commit(repo_id=repo_id, operations=operations, commit_message=commit_message, **commit_kwargs)


def save_pretrained(model, stock_save, save_directory, *args, push_to_hub: bool = False, overwrite: bool = True,
                    **kwargs):
    """transformers' `save_pretrained` (`stock_save`), written atomically (`staged_output`), with the QuantMLA card.

    A checkpoint already in the folder is replaced whole, as transformers' `save_pretrained` replaces it (its common
    tests save twice into one folder); `overwrite=False` refuses it instead (`OutputError`), which the CLI does
    unless `--overwrite`. With `push_to_hub=True` exactly the files this save wrote are uploaded (what `push_to_hub`
    uploads), never other files lying in the folder.
    """
    hub_kwargs = {k: kwargs.pop(k) for k in HUB_SAVE_KWARGS if k in kwargs}
    if not kwargs.get("is_main_process", True):
        return stock_save(save_directory, *args, **kwargs)
    repo_id = api = None
    if push_to_hub:
        api = HfApi(token=kwargs.get("token"))
        repo_id = hub_kwargs.pop("repo_id", None) or os.path.basename(os.path.normpath(save_directory))
        repo_id = api.create_repo(repo_id, private=hub_kwargs.pop("private", None), exist_ok=True).repo_id
    with staged_directory(save_directory, overwrite=overwrite) as staged:
        out = stock_save(staged.path, *args, **kwargs)
        if not has_own_card(staged.destination):
            write_model_card(model, staged.path, repo_id=repo_id)
    if not push_to_hub:
        return out
    # transformers would upload its generic card; upload this save's files, with ours, and nothing else.
    return upload_saved_files(api, repo_id, staged.destination, staged.files,
                              hub_kwargs.pop("commit_message", None) or "Upload QuantMLA model", **hub_kwargs)


def push_to_hub(model, stock_save, repo_id: str, *, commit_message: str | None = None,
                commit_description: str | None = None, private: bool | None = None, token=None,
                revision: str | None = None, create_pr: bool = False, max_shard_size="50GB",
                tags: list[str] | None = None, base_model: str | None = None, eval_results: dict | None = None,
                measured_tokens: int = 4096):
    """Upload the quantized checkpoint and its QuantMLA model card to `repo_id` (on `HF_ENDPOINT`).

    Takes every argument of transformers' `push_to_hub` (passed on to the Hub as it would) and the model card's
    `base_model`, `eval_results`, `measured_tokens` (see `model_card.render_model_card`).
    """
    api = HfApi(token=token)
    repo_id = api.create_repo(repo_id, private=private, exist_ok=True).repo_id
    with tempfile.TemporaryDirectory() as tmp:
        with write_errors(tmp, "Free space there or set TMPDIR to another folder"):
            stock_save(tmp, max_shard_size=max_shard_size)
            write_model_card(model, tmp, overwrite=True, repo_id=repo_id, tags=tags, base_model=base_model,
                             eval_results=eval_results, measured_tokens=measured_tokens)
        return api.upload_folder(
            repo_id=repo_id, folder_path=tmp, commit_message=commit_message or "Upload QuantMLA model",
            commit_description=commit_description, revision=revision, create_pr=create_pr,
        )
