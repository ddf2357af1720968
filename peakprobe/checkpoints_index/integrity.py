"""Checkpoint integrity: which checkpoints serve weight files identical to another checkpoint's.

Published families have revisions that are not what their name says (several Pythia sizes
serve the final model's weights, whole or in one shard, under early step branches; some OLMo-2
branches are byte-identical). Each weight file is identified by its sha256 (hub LFS hash, HF
cache blob name, or content hash of a local file); checkpoints sharing a hash are grouped.

Rule (docs/architecture.md): in each group the checkpoint whose step is the family's final step
keeps the file when it is in the group; else, when the repo's ``main`` weights are in the group,
``main`` keeps it (every selected checkpoint in the group is flagged); else the highest step
keeps it. Every other member is flagged, with the files it shares and whether that is all of
its weight files (``whole``) or some shards only.
"""

from __future__ import annotations

from collections import defaultdict

from .cache import cached_refs, cached_weight_hashes, folder_weight_hashes, hub_weight_hashes
from .families import PYTHIA_TOTAL_STEPS
from .records import CheckpointSequence

FORMAT = 1
MAIN = "main"
RULE = (
    "among checkpoints sharing a weight file, the final-step one keeps it (else the repo's main, "
    "else the highest step); the others are flagged"
)


def find_duplicates(
    hashes: dict[str, dict[str, str]],
    steps: dict[str, int],
    *,
    final_step: int | None = None,
    main: dict[str, str] | None = None,
) -> dict[str, dict]:
    """``{flagged revision: {"step", "duplicates", "files", "whole"}}`` from per-revision
    ``{file: sha256}`` maps. ``main`` is the repo's final model when it is not a selected revision."""
    holders: dict[str, list[tuple[str, str]]] = defaultdict(list)  # sha -> [(revision, file)]
    for rev, files in hashes.items():
        for name, sha in files.items():
            holders[sha].append((rev, name))
    main_shas = set((main or {}).values())
    flagged: dict[str, dict] = {}
    for sha, members in holders.items():
        revs = sorted({r for r, _ in members}, key=lambda r: steps[r])
        if len(revs) + (sha in main_shas) < 2:
            continue
        finals = [r for r in revs if final_step is not None and steps[r] == final_step]
        keeper = finals[0] if finals else (MAIN if sha in main_shas else revs[-1])
        group = revs + ([MAIN] if sha in main_shas and MAIN not in revs else [])
        for rev, name in members:
            if rev == keeper:
                continue
            entry = flagged.setdefault(rev, {"step": steps[rev], "duplicates": set(), "files": set()})
            entry["duplicates"].update(g for g in group if g != rev)
            entry["files"].add(name)
    order = {r: i for i, r in enumerate(sorted(steps, key=steps.get))}
    return {
        rev: {
            "step": e["step"],
            "duplicates": sorted(e["duplicates"], key=lambda r: order.get(r, len(order))),
            "files": sorted(e["files"]),
            "whole": e["files"] == set(hashes[rev]),
        }
        for rev, e in sorted(flagged.items(), key=lambda kv: steps[kv[0]])
    }


def collect_hashes(
    seq: CheckpointSequence, *, offline: bool, token: str | None = None
) -> tuple[dict[str, dict[str, str]], dict[str, str] | None]:
    """Per-revision weight hashes of ``seq`` (local folders, else the HF cache, else the hub tree
    API when online) and those of the repo's ``main`` when it is not one of the revisions.
    Revisions whose hashes cannot be read are left out (reported as unchecked)."""
    hashes: dict[str, dict[str, str]] = {}
    hub = any(c.path is None for c in seq)
    cached = cached_refs(seq.source) if hub else {}
    for c in seq:
        if c.path is not None:
            got = folder_weight_hashes(c.path)
        elif c.revision in cached:
            got = cached_weight_hashes(seq.source, c.revision)
        else:
            got = None if offline else hub_weight_hashes(seq.source, c.revision, token)
        if got:
            hashes[c.revision] = got
    main = None
    if hub and MAIN not in seq.revisions:
        if MAIN in cached:
            main = cached_weight_hashes(seq.source, MAIN)
        elif not offline:
            main = hub_weight_hashes(seq.source, MAIN, token)
    return hashes, main


def integrity_record(seq: CheckpointSequence, *, offline: bool, token: str | None = None) -> dict:
    """The ``integrity.json`` content for ``seq`` (format in docs/architecture.md)."""
    hashes, main = collect_hashes(seq, offline=offline, token=token)
    steps = {c.revision: c.step for c in seq}
    final_step = PYTHIA_TOTAL_STEPS if seq.family == "pythia" else None
    flagged = find_duplicates(hashes, steps, final_step=final_step, main=main)
    return {
        "format": FORMAT,
        "hash": "sha256",
        "rule": RULE,
        "checked": [c.revision for c in seq if c.revision in hashes],
        "unchecked": [c.revision for c in seq if c.revision not in hashes],
        "flagged": flagged,
    }
