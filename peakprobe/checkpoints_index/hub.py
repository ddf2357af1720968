"""Hub listing: a repo's branches (``huggingface_hub.list_repo_refs``) as a CheckpointSequence.

Branch names are recognised as Pythia (``step<N>``), OLMo-1 (``step<N>-tokens<X>B``), OLMo-2
(``stage1-step<N>-tokens<X>B``, ``stage2-ingredient<I>-step<N>-tokens<X>B``) or LLM360 Amber
(``ckpt_NNN``, with ``main`` = checkpoint 359). ``huggingface_hub`` is imported only here and
only when called. With ``HF_HUB_OFFLINE=1`` or no connection the branches come from the local HF
cache (:func:`from_cache`); with nothing cached an :class:`OfflineError` says what works
offline. The name-to-sequence step (:func:`sequence_from_branches`) needs no network; it
attaches the published schedules of :mod:`.published` (tau) where a repo has one.
"""

from __future__ import annotations

import os
import re
import socket
import warnings
from collections import defaultdict

from .cache import cached_refs
from .errors import CheckpointIndexWarning, HubError, OfflineError, UnknownFamilyError, one_line
from .families import BUILTIN_FAMILIES_TEXT, LOCAL_FOLDER_TEXT, match_pythia, pythia
from .names import (
    AMBER_MAIN_INDEX,
    olmo2_line,
    parse_amber_revision,
    parse_olmo1_revision,
    parse_olmo2_revision,
    parse_pythia_revision,
)
from .published import AMBER_CHUNK_TOKENS, published_run
from .records import Checkpoint, CheckpointSequence

HUB_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*")
_TRUE = {"1", "true", "yes", "on"}
_NETWORK_ERROR_NAMES = {
    "OfflineModeIsEnabled",
    "ConnectError",
    "ConnectTimeout",
    "ConnectionError",
    "NetworkError",
    "ProxyError",
    "ReadTimeout",
    "TimeoutException",
    "TransportError",
}
_OLMO_RE = re.compile(r"(?:stage\d+-)?(?:ingredient\d+-)?step\d+-tokens.+")
_STAGE_PREFIX_RE = re.compile(r"stage\d+-")
_SCHEMES = ("pythia", "olmo", "amber")


def offline_requested() -> bool:
    """True when the environment asks the hub libraries to stay offline."""
    return any(
        os.environ.get(v, "").strip().lower() in _TRUE
        for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    )


def _offline_error(repo_id: str, reason: str) -> OfflineError:
    return OfflineError(
        f"cannot list the revisions of {repo_id}: {reason}; without the hub use the {BUILTIN_FAMILIES_TEXT} "
        f"(e.g. peakprobe index pythia-70m) or {LOCAL_FOLDER_TEXT} (e.g. peakprobe index ./my_run)"
    )


def is_network_error(exc: BaseException) -> bool:
    """Whether ``exc`` (or what caused it) is a failed connection rather than a hub answer."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, (ConnectionError, TimeoutError, socket.gaierror)):
            return True
        if any(cls.__name__ in _NETWORK_ERROR_NAMES for cls in type(current).__mro__):
            return True
        current = current.__cause__ or current.__context__
    return False


def check_hub_reachable(repo_id: str, timeout: float = 5.0) -> None:
    """Fail fast, with what to do, when the hub cannot be reached for ``repo_id``'s weights.

    Without this, every file of every checkpoint would first go through the hub libraries'
    retries (about 50 s each) before falling back to the cache. Skipped in offline mode
    (``HF_HUB_OFFLINE=1``), where the libraries read the local cache directly; any HTTP answer,
    even an error status, counts as reachable.
    """
    if offline_requested():
        return
    import huggingface_hub
    from huggingface_hub import constants

    try:
        huggingface_hub.get_session().head(constants.ENDPOINT, timeout=timeout)
    except Exception as exc:
        if not is_network_error(exc):
            raise
        raise OfflineError(
            f"the hub ({constants.ENDPOINT}) is unreachable ({type(exc).__name__}), so {repo_id} "
            "cannot be loaded from it: if its revisions are in your Hugging Face cache, set "
            f"HF_HUB_OFFLINE=1 to read them from there; otherwise use {LOCAL_FOLDER_TEXT}"
        ) from None


def from_hub(
    repo_id: str, *, token: str | None = None, stage: str | None = None
) -> CheckpointSequence:
    """List ``repo_id``'s branches on the hub and index those that follow a known naming scheme.

    ``stage`` picks the OLMo-2 training line (default ``stage1``; e.g. ``stage2-ingredient1``).
    """
    if not HUB_ID_RE.fullmatch(repo_id):
        raise HubError(
            f"{repo_id!r} is not a hub repo id; expected owner/name, e.g. allenai/OLMo-2-1124-7B"
        )
    if offline_requested():
        return from_cache(repo_id, stage=stage, reason="offline mode is on (HF_HUB_OFFLINE=1)")
    try:
        import huggingface_hub
    except ImportError:
        raise HubError(
            "listing hub revisions needs huggingface_hub: pip install 'peakprobe[hub]'; "
            f"or use the {BUILTIN_FAMILIES_TEXT} or {LOCAL_FOLDER_TEXT}"
        ) from None
    try:
        refs = huggingface_hub.list_repo_refs(repo_id, token=token)
    except Exception as exc:
        if is_network_error(exc):
            return from_cache(
                repo_id, stage=stage, reason=f"the hub is unreachable ({type(exc).__name__})"
            )
        names = {cls.__name__ for cls in type(exc).__mro__}
        if "GatedRepoError" in names:
            raise HubError(
                f"hub repo {repo_id} is gated: accept its conditions on its hub page, then log in "
                "with `hf auth login` (or set HF_TOKEN)"
            ) from None
        if "RepositoryNotFoundError" in names:
            raise HubError(
                f"hub repo {repo_id} was not found: check the id; a private repo needs you to log in "
                "with `hf auth login` (or set HF_TOKEN); or give a local folder path"
            ) from None
        if "HfHubHTTPError" in names:
            raise HubError(f"the hub refused to list {repo_id}: {one_line(exc)[:300]}") from None
        raise
    return sequence_from_branches(repo_id, [b.name for b in refs.branches], stage=stage)


def from_cache(repo_id: str, *, stage: str | None = None, reason: str = "offline") -> CheckpointSequence:
    """Index the branches of ``repo_id`` held in the local HF cache (no network)."""
    refs = cached_refs(repo_id)
    if not refs:
        raise _offline_error(repo_id, f"{reason} and the HF cache holds none of its revisions")
    return sequence_from_branches(repo_id, list(refs), stage=stage)


def _scheme_of(name: str) -> str | None:
    if _OLMO_RE.fullmatch(name):
        return "olmo"
    if re.fullmatch(r"step\d+", name):
        return "pythia"
    if re.fullmatch(r"ckpt_\d{3}", name):
        return "amber"
    return None


def sequence_from_branches(
    repo_id: str, branches: list[str], stage: str | None = None
) -> CheckpointSequence:
    """Index a list of branch names (no network): the naming scheme most branches follow wins.

    Branches of other schemes are skipped with a warning; ``main`` is skipped except for Amber,
    where it is checkpoint 359.
    """
    by_scheme: dict[str, list[str]] = defaultdict(list)
    other: list[str] = []
    for name in sorted(set(branches)):
        scheme = _scheme_of(name)
        (by_scheme[scheme] if scheme else other).append(name)
    if not by_scheme:
        shown = ", ".join(sorted(branches)[:6]) or "none"
        raise HubError(
            f"{repo_id} has no checkpoint branches in a known naming scheme (branches: {shown}); "
            "known: Pythia step<N>, OLMo-1 step<N>-tokens<X>B, OLMo-2 stage1-step<N>-tokens<X>B, Amber ckpt_NNN"
        )
    scheme = max(_SCHEMES, key=lambda s: (len(by_scheme.get(s, [])), -_SCHEMES.index(s)))
    skipped = [n for s, names in by_scheme.items() if s != scheme for n in names]
    skipped += [n for n in other if n != "main"]  # main duplicates the last step, or is Amber's 359
    if skipped:
        warnings.warn(
            f"{repo_id}: skipped {len(skipped)} branches not following the {scheme} naming "
            f"(e.g. {', '.join(skipped[:4])})",
            CheckpointIndexWarning,
            stacklevel=2,
        )
    if stage is not None and scheme != "olmo":
        raise HubError(
            f"stage={stage!r} only applies to OLMo-2 repos; {repo_id} uses {scheme} names"
        )
    names = by_scheme[scheme]
    if scheme == "pythia":
        return _pythia_like(repo_id, names)
    if scheme == "amber":
        return _amber(repo_id, names, has_main="main" in other)
    return _olmo(repo_id, names, stage)


def _pythia_like(repo_id: str, names: list[str]) -> CheckpointSequence:
    steps = [parse_pythia_revision(n) for n in names]
    try:
        match = match_pythia(repo_id) if repo_id.lower().startswith("eleutherai/") else None
    except UnknownFamilyError:  # a Pythia-like repo outside the built-in table: no tokens/tau
        match = None
    if match is not None:
        return pythia(match[0], deduped=match[1], steps=tuple(steps), seed=match[2])
    checkpoints = [Checkpoint(n, s, None, None) for n, s in zip(names, steps, strict=True)]
    return CheckpointSequence(repo_id.split("/")[-1], repo_id, checkpoints, None, None)


def _amber(repo_id: str, names: list[str], has_main: bool) -> CheckpointSequence:
    run = published_run(repo_id)
    pairs = [(n, parse_amber_revision(n)) for n in names]
    if has_main and all(k != AMBER_MAIN_INDEX for _, k in pairs):
        pairs.append(("main", AMBER_MAIN_INDEX))
    # ckpt_k is saved after data chunk k: k + 1 chunks seen
    checkpoints = [
        Checkpoint(n, k, (k + 1) * AMBER_CHUNK_TOKENS if run else None,
                   float(run.schedule.tau(k + 1)) if run else None)
        for n, k in pairs
    ]
    return CheckpointSequence(repo_id.split("/")[-1], repo_id, checkpoints,
                              run.schedule if run else None, "amber")


def _olmo(repo_id: str, names: list[str], stage: str | None) -> CheckpointSequence:
    is_olmo2 = "olmo-2" in repo_id.lower() or any(_STAGE_PREFIX_RE.match(n) for n in names)
    if not is_olmo2:
        if stage is not None:
            raise HubError(
                f"stage={stage!r} only applies to OLMo-2 repos; {repo_id} has OLMo-1 names"
            )
        parsed = [(n, *parse_olmo1_revision(n)) for n in names]
        return _dedup_olmo(repo_id, parsed, "olmo1")
    lines: dict[str, list[str]] = defaultdict(list)
    for n in names:
        lines[olmo2_line(n)].append(n)
    want = stage or "stage1"
    if want not in lines:
        raise HubError(
            f"{repo_id} has no {want} branches; training lines: {', '.join(sorted(lines))}"
        )
    others = sorted(set(lines) - {want})
    if others:
        warnings.warn(
            f"{repo_id}: indexing the {want} line only; pass stage= for the others: {', '.join(others)}",
            CheckpointIndexWarning,
            stacklevel=3,
        )
    parsed = []
    for n in lines[want]:
        rev = parse_olmo2_revision(n)
        parsed.append((n, rev.step, rev.tokens))
    return _dedup_olmo(repo_id, parsed, "olmo2", line=want)


def _dedup_olmo(
    repo_id: str, parsed: list[tuple[str, int, int]], family: str, line: str | None = None
) -> CheckpointSequence:
    """One checkpoint per step (the first name in sorted order), warning about any dropped.

    The published schedule (tau) applies to OLMo-1 and to the OLMo-2 ``stage1`` line only: the
    stage-2 anneals restart their step counter with their own schedule."""
    by_step: dict[int, tuple[str, int]] = {}
    dropped: list[str] = []
    for name, step, tokens in sorted(parsed):
        if step in by_step:
            dropped.append(name)
        else:
            by_step[step] = (name, tokens)
    if dropped:
        warnings.warn(
            f"{repo_id}: {len(dropped)} branches repeat a step and were skipped (e.g. {', '.join(dropped[:3])})",
            CheckpointIndexWarning,
            stacklevel=3,
        )
    run = published_run(repo_id) if family == "olmo1" or line == "stage1" else None
    checkpoints = [
        Checkpoint(name, step, tokens, float(run.schedule.tau(step)) if run else None)
        for step, (name, tokens) in by_step.items()
    ]
    return CheckpointSequence(repo_id.split("/")[-1], repo_id, checkpoints,
                              run.schedule if run else None, family)
