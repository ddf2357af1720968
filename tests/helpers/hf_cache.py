"""Test helper: put save_pretrained folders into a Hugging Face hub cache laid out exactly as
huggingface_hub writes it (refs/<branch> -> commit; snapshots/<commit>/<file> symlinks into
blobs/, LFS files named by their sha256, others by their git blob sha1), so that
``huggingface_hub.scan_cache_dir`` and ``from_pretrained(..., local_files_only=True)`` accept it."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

LFS_SUFFIXES = (".safetensors", ".bin")


def _blob_name(path: Path) -> str:
    data = path.read_bytes()
    if path.name.endswith(LFS_SUFFIXES):
        return hashlib.sha256(data).hexdigest()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()  # git's blob id


def cache_revision(hub_dir: Path, repo_id: str, branch: str, folder: Path) -> str:
    """Copy ``folder``'s files into the cache as ``repo_id`` at ``branch``; returns the commit."""
    repo = Path(hub_dir) / ("models--" + repo_id.replace("/", "--"))
    commit = hashlib.sha1(f"{repo_id}@{branch}".encode()).hexdigest()
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True, exist_ok=True)
    (repo / "blobs").mkdir(exist_ok=True)
    for path in sorted(Path(folder).iterdir()):
        if not path.is_file():
            continue
        blob = repo / "blobs" / _blob_name(path)
        if not blob.exists():
            shutil.copyfile(path, blob)
        link = snapshot / path.name
        if link.is_symlink() or link.exists():
            link.unlink()
        os.symlink(os.path.relpath(blob, snapshot), link)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / branch).write_text(commit)  # no trailing newline, as huggingface_hub writes
    return commit
