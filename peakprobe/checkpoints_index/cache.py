"""The local Hugging Face cache: which revisions of a repo it holds, their weight-file hashes,
and deleting revisions from it.

Layout (as ``huggingface_hub`` writes it): ``HF_HUB_CACHE`` (default ``HF_HOME/hub``, default
``~/.cache/huggingface/hub``) holds ``models--OWNER--NAME/`` with ``refs/<branch>`` (a commit
hash), ``snapshots/<commit>/<file>`` (symlinks) and ``blobs/<sha256>`` for LFS files. The cache
location is read from the environment at call time, so a changed ``HF_HOME`` is honoured.
Listing and hashing need no network; deletion goes through ``huggingface_hub.scan_cache_dir``.
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path

_SHA256_RE = re.compile(r"[0-9a-f]{64}")
CONFIG_FILE = "config.json"


def hub_cache_dir() -> Path:
    """The hub cache folder: ``HF_HUB_CACHE``, else ``HF_HOME/hub``, else ``~/.cache/huggingface/hub``."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join("~", ".cache"), "huggingface"
    )
    return Path(home).expanduser() / "hub"


def repo_folder(repo_id: str) -> Path:
    """``HF_HUB_CACHE/models--OWNER--NAME`` of a model repo."""
    return hub_cache_dir() / ("models--" + repo_id.replace("/", "--"))


def cached_refs(repo_id: str) -> dict[str, str]:
    """Branch name -> commit for every branch of ``repo_id`` whose snapshot in the cache holds a
    ``config.json`` (a loadable checkpoint); empty when the repo is not cached."""
    folder = repo_folder(repo_id)
    refs = folder / "refs"
    if not refs.is_dir():
        return {}
    out: dict[str, str] = {}
    for ref in sorted(refs.iterdir()):
        if not ref.is_file():  # refs/pr/<n> and other nested refs are not branches
            continue
        commit = ref.read_text().strip()
        if (folder / "snapshots" / commit / CONFIG_FILE).exists():
            out[ref.name] = commit
    return out


def is_weight_file(name: str) -> bool:
    """Model weights (every shard), not optimizer / trainer state that repeats across checkpoints."""
    base = name.rsplit("/", 1)[-1]
    if base.endswith(".safetensors"):
        return True
    return base.endswith(".bin") and base.startswith(("pytorch_model", "model"))


def file_sha256(path: Path, chunk: int = 1 << 20) -> str:
    """The sha256 of a file's content (read in 1 MiB chunks)."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def folder_weight_hashes(folder: str | Path) -> dict[str, str]:
    """``{weight file name: sha256}`` of a local checkpoint folder (content hashes)."""
    folder = Path(folder)
    return {p.name: file_sha256(p) for p in sorted(folder.iterdir()) if p.is_file() and is_weight_file(p.name)}


def cached_weight_hashes(repo_id: str, revision: str) -> dict[str, str] | None:
    """``{weight file: sha256}`` of a cached revision without reading the weights: the blob a
    snapshot file links to is named by its LFS sha256. None when the revision is not cached."""
    commit = cached_refs(repo_id).get(revision)
    if commit is None:
        return None
    snapshot = repo_folder(repo_id) / "snapshots" / commit
    out: dict[str, str] = {}
    for path in sorted(snapshot.iterdir()):
        if not is_weight_file(path.name):
            continue
        target = Path(os.readlink(path)).name if path.is_symlink() else ""
        out[path.name] = target if _SHA256_RE.fullmatch(target) else file_sha256(path)
    return out


def hub_weight_hashes(repo_id: str, revision: str, token: str | None = None) -> dict[str, str] | None:
    """``{weight file: LFS sha256}`` from the hub's tree API (no download); None on any failure."""
    try:
        from huggingface_hub import HfApi

        entries = HfApi().list_repo_tree(repo_id, revision=revision, token=token, expand=True)
        out = {}
        for entry in entries:
            lfs = getattr(entry, "lfs", None)
            if is_weight_file(entry.path) and lfs is not None:
                out[entry.path] = lfs.sha256
        return out
    except Exception:  # integrity is best effort: an unreadable revision stays unchecked
        return None


def delete_cached_revisions(repo_id: str, revisions: list[str]) -> list[str]:
    """Delete ``revisions`` of ``repo_id`` from the cache (``scan_cache_dir().delete_revisions``,
    which keeps blobs another cached revision still uses). Returns the revisions deleted."""
    refs = cached_refs(repo_id)
    commits = {refs[r] for r in revisions if r in refs}
    if not commits:
        return []
    from huggingface_hub import scan_cache_dir

    scan_cache_dir(hub_cache_dir()).delete_revisions(*sorted(commits)).execute()
    return [r for r in revisions if r in refs]
