"""Probing under ``torch.distributed``: every rank probes its share, one merge per probe.

``layout_of`` reads how a model is spread over the processes: replicas (DDP, the wrapper
unwrapped, or one full model per rank), FSDP2 (``fully_shard``: every rank runs the whole
forward, FSDP gathering each layer's weights) or tensor parallel (DTensor parameters on a 1-D
mesh, ``parallelize_module``: each rank computes its local heads). ``probe_ranks`` then runs
the probe forward on every rank:

* **Windows.** The evaluation batches (``EvalData.batches``, the single-process ones) are split
  into contiguous blocks, one per data-parallel rank (the first ranks take one more), so every window is probed exactly once
  and each forward sees the batch a single process would. Under FSDP2 the forward is collective,
  so a rank with one batch fewer runs one more forward whose statistics are discarded. Under
  tensor parallel every rank runs every batch (its heads).
* **One merge.** The per-site accumulators are packed into one float64 tensor per reduce op and
  reduced with one all-reduce each (``probes.merge``): sums, counts and histograms SUM, maxima
  MAX. A tensor-parallel rank places its local heads at their global indices (rank r of n holds
  heads r H/n ... (r+1) H/n - 1, as Colwise sharding of the query projection gives); groups every
  tensor-parallel rank computes whole (a replicated LM head) count on rank 0 of the mesh. The
  per-head tables kept outside the accumulators ride on the same SUM all-reduce: the query-key
  geometry sums (every rank's batches), the head-role sums of the diagnostic batch (run on every
  rank, counted by data-parallel rank 0), each head's ``qk_spectral_norm`` (a weight figure read
  inside the forward, where FSDP2 has gathered the layer's weights and a tensor-parallel rank
  holds its own heads' rows; counted by data-parallel rank 0, so no extra collective) and the
  unembedding's row-norm sums.
* **Vocab-parallel LM head.** Logits that arrive as a DTensor sharded on the vocabulary are
  reduced per shard to mergeable per-row sums and all-gathered once per batch; the parts merge
  exactly (max and log-sum-exp combined, ``probes.merge.merge_row_parts``), the target logit
  taken from the shard that holds it.
* **Failures.** The statistics hooks are guarded: a rank whose statistics raise records the
  error, lets the model's forward go on (so every collective of the forward still happens),
  and contributes zeros with its failure flag (one slot per rank in the SUM tensor). Every rank
  then knows who failed; only then are the messages gathered, and the probe is dropped on every
  rank. A rank that raises inside the model's own forward under FSDP2 / tensor parallel stops
  its peers at the forward's next collective: they wait for the process group's timeout
  (``init_process_group(timeout=...)``). The merge itself waits at most ``timeout`` seconds and
  then raises ``DistributedProbeError`` (training stops instead of hanging).

Attribution (gains) runs on rank 0 alone for replicas (the whole model is there; no
collective). Under FSDP2 and tensor parallel it is skipped: its searches run a data-dependent
number of tempered forwards per head, and a collective forward needs every rank in lockstep.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta

import pandas as pd
import torch
import torch.distributed as dist

from .. import vocab
from ..attribution import attribute
from ..checkpoint import check_model, uses_attention_interface
from ..config import SweepConfig
from ..data import EvalData
from ..hooks import UnsupportedModelError, attach
from ..hooks.engine import geometry_rows, lm_head_factors, role_rows, spectral_rows, unembed_sums
from ..hooks.sdpa import attach_sdpa
from ..probes import Accumulator, SiteGroup
from ..probes.accumulate import SiteSums
from ..probes.geometry import GEOMETRY_SUMS
from ..probes.merge import (
    MAX,
    SUM,
    Placement,
    merge_row_parts,
    pack_layers,
    reduce_accumulator,
    stack_sums,
    unpack_layers,
    zeros_like,
)
from ..probes.rows import attn_metric_names, block_sums, finish

REPLICAS, FSDP, TP = "replicas", "fsdp2", "tensor-parallel"
#: why the attribution does not run on a sharded model (logged once, kept in monitor.json)
GAINS_SKIPPED = ("gains are skipped under FSDP2 and tensor parallel: the attribution's searches run "
                 "a data-dependent number of tempered forwards per head, and a sharded forward is "
                 "collective (every rank in lockstep); the statistics and growth laws are measured")
DEFAULT_TIMEOUT = 600.0  # seconds the merge waits for its peers


class DistributedProbeError(vocab.PeakprobeError):
    """A distributed probe that cannot run: an unsupported mesh, or peers that never joined."""


@dataclass(frozen=True)
class Layout:
    """How the model lies over the processes (see the module doc)."""

    kind: str = REPLICAS
    rank: int = 0
    world: int = 1
    dp_rank: int = 0
    dp_size: int = 1
    tp_rank: int = 0
    tp_size: int = 1

    @property
    def sharded(self) -> bool:
        """True when the forward is collective (FSDP2, tensor parallel)."""
        return self.kind in (FSDP, TP)

    def describe(self) -> dict:
        return {"kind": self.kind, "world": self.world, "data_parallel": self.dp_size,
                "tensor_parallel": self.tp_size}


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The module inside a ``DistributedDataParallel`` wrapper (probing needs no gradient sync)."""
    return model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model


def _dtensor_meshes(model: torch.nn.Module) -> list:
    from torch.distributed.tensor import DTensor

    return [p.device_mesh for p in model.parameters() if isinstance(p, DTensor)]


def layout_of(model: torch.nn.Module) -> Layout:
    """The model's ``Layout`` in the current process group (one process: the default)."""
    if not is_distributed():
        return Layout()
    from torch.distributed.fsdp import FSDPModule

    rank, world = dist.get_rank(), dist.get_world_size()
    model = unwrap(model)
    meshes = _dtensor_meshes(model)
    if any(m.ndim != 1 for m in meshes):
        raise DistributedProbeError("a 2-D device mesh (FSDP2 with tensor parallel, HSDP) is not supported: "
                                    "peakprobe probes FSDP2, tensor parallel or replicas over one 1-D mesh")
    if any(isinstance(m, FSDPModule) for m in model.modules()):
        return Layout(FSDP, rank, world, rank, world)
    if meshes:
        mesh = meshes[0]
        if mesh.size() != world:
            raise DistributedProbeError(f"a tensor-parallel mesh of {mesh.size()} ranks in a world of {world}: "
                                        "peakprobe probes tensor parallel over the whole world")
        return Layout(TP, rank, world, 0, 1, mesh.get_local_rank(), mesh.size())
    return Layout(REPLICAS, rank, world, rank, world)


def rank_batches(data: EvalData, batch_size: int, layout: Layout) -> tuple[list, int]:
    """(this rank's batches, the padding forwards it runs): a contiguous block of the
    single-process batches per data-parallel rank; under FSDP2 every rank runs as many forwards
    as the rank with the most batches."""
    batches = list(data.batches(batch_size))
    n, k, r = len(batches), layout.dp_size, layout.dp_rank
    first = r * (n // k) + min(r, n % k)  # the first n % k ranks take one batch more
    mine = batches[first : first + n // k + (r < n % k)]
    # a collective forward needs as many forwards on every rank; a replica with no batch runs
    # one anyway, so that its (dropped) statistics give the merge its layout
    pad = (-(-n // k) - len(mine)) if layout.sharded else int(not mine)
    return mine, pad


def placement(layout: Layout, global_heads: int | None) -> Callable[[SiteGroup, int], Placement]:
    """Where this rank's heads go in the merged frame (``probes.merge.pack``'s ``place``)."""

    def place(group: SiteGroup, local: int) -> Placement:
        if layout.tp_size == 1:
            return (0, local)
        if group.kind == vocab.ATTN and global_heads and local * layout.tp_size == global_heads:
            return (layout.tp_rank * local, global_heads)
        if group.kind == vocab.ATTN and global_heads and local != global_heads:
            raise DistributedProbeError(f"layer {group.layer} has {local} heads on rank {layout.rank}; "
                                        f"{global_heads} heads over {layout.tp_size} ranks cannot be mapped")
        return (0, local) if layout.tp_rank == 0 else None  # computed whole on every rank: count once

    return place


def _all_reduce(timeout: float) -> Callable[[torch.Tensor, str], None]:
    ops = {SUM: dist.ReduceOp.SUM, MAX: dist.ReduceOp.MAX}

    def reduce(tensor: torch.Tensor, op: str) -> None:
        work = dist.all_reduce(tensor, op=ops[op], async_op=True)
        try:
            work.wait(timeout=timedelta(seconds=timeout))
        except RuntimeError as exc:
            raise DistributedProbeError(
                f"rank {dist.get_rank()}: the probe's merge waited {timeout:g} s for the other ranks "
                f"({str(exc).splitlines()[0]})") from exc

    return reduce


class _Guard:
    """Wraps a probe's statistics calls: the first error is kept, later calls only note their
    group (so the merged layout stays whole) and the model's forward goes on."""

    def __init__(self, stats) -> None:
        self.stats = stats
        self.error: BaseException | None = None
        self.trace = ""
        self._attention, self._lm_head = stats.attention, stats.lm_head
        stats.attention, stats.lm_head = self.attention, self.lm_head

    def _fail(self, exc: BaseException) -> None:
        if self.error is None:
            self.error, self.trace = exc, traceback.format_exc(limit=5)

    def _placeholder(self, group: SiteGroup, names: tuple[str, ...], heads: int) -> None:
        z = torch.zeros(heads, len(names), dtype=torch.float64)
        hist = torch.zeros(heads, len(vocab.QUANTILE_OF), vocab.HIST_BINS, dtype=torch.float64)
        self.stats.accumulator.add(group, SiteSums(names, z, z.clone(), torch.full((heads,), float("-inf"),
                                                                                 dtype=torch.float64), hist))

    def attention(self, layer, query, key, value, **kw):
        if self.error is None:
            try:
                return self._attention(layer, query, key, value, **kw)
            except Exception as exc:  # noqa: BLE001 - kept and reported by rank 0
                self._fail(exc)
        self._placeholders(layer, query.shape[1], kw)
        return None

    def _placeholders(self, layer: int, heads: int, kw: dict) -> None:
        """Zeros where a failed call left a layer's slots empty (the merged layout stays whole)."""
        st, f64 = self.stats, torch.float64
        if layer not in st.spectral_parts:
            st.spectral_parts[layer] = torch.zeros(heads, 2, dtype=f64)
        if st.role_targets is not None:
            if layer not in st.role_parts:
                r = len(vocab.ROLE_METRICS)
                st.role_parts[layer] = (torch.zeros(heads, r, dtype=f64), torch.zeros(heads, r, dtype=f64))
            return
        if layer not in st.geometry_parts:
            st.geometry_parts[layer] = (torch.zeros(heads, len(GEOMETRY_SUMS), dtype=f64), kw.get("scaling", 1.0))
        group = SiteGroup(vocab.ATTN, layer)
        if group not in st.accumulator.groups():
            self._placeholder(group, attn_metric_names(kw.get("sinks") is not None), heads)

    def lm_head(self, logits, kept, target, hidden=None):
        # a vocab-parallel head gathers across the ranks: it takes part even after an error
        if self.error is None or _vocab_sharded(logits):
            try:
                return self._lm_head_call(logits, kept, target, hidden)
            except Exception as exc:  # noqa: BLE001
                self._fail(exc)
        group = SiteGroup(vocab.LM_HEAD, -1)
        if group not in self.stats.accumulator.groups():
            self._placeholder(group, vocab.LM_PROBE_METRICS, 1)
        return None

    def _lm_head_call(self, logits, kept, target, hidden=None):
        from torch.distributed.tensor import DTensor

        if _vocab_sharded(logits):
            return vocab_parallel_lm_head(self.stats, logits, kept, target, hidden)
        if isinstance(logits, DTensor):
            logits = logits.full_tensor()  # replicated (or sharded elsewhere): the whole logits
        if isinstance(hidden, DTensor):
            hidden = hidden.full_tensor()
        return self._lm_head(logits, kept, target, hidden)


def _vocab_sharded(logits) -> bool:
    """True for logits that are a DTensor sharded on the vocabulary (the last dimension)."""
    from torch.distributed.tensor import DTensor, Shard

    return isinstance(logits, DTensor) and any(
        isinstance(p, Shard) and p.dim % logits.ndim == logits.ndim - 1 for p in logits.placements)


def vocab_parallel_lm_head(stats, logits, kept: torch.Tensor, target: torch.Tensor,
                           hidden: torch.Tensor | None = None) -> None:
    """Add the LM head's statistics of ``logits`` (a DTensor (B, T, V) sharded on V) to
    ``stats``: per-row sums of the local shard, one all-gather over the mesh, parts merged
    exactly; every rank adds the same whole rows."""
    from torch.distributed.tensor import DTensor

    f64 = torch.float64
    mesh = logits.device_mesh
    local = logits.to_local().detach()  # (B, T, V_r)
    n, r, v = mesh.size(), mesh.get_local_rank(), logits.shape[-1]
    v0 = min(r * -(-v // n), v)  # Shard's chunks: ceil(V / n) per rank
    z = local.to(stats.dtype)
    target = target.to(z.device)
    t = target - v0
    inside = (target >= 0) & (t >= 0) & (t < z.shape[-1])  # (B, T): this shard holds the target
    zt = z.gather(-1, t.clamp(0, max(z.shape[-1] - 1, 0)).unsqueeze(-1)).squeeze(-1).to(f64)
    with torch.no_grad():
        part = block_sums(z, work=stats.work)  # (B, T) sums over V_r
        mine = torch.cat([stack_sums(part), torch.where(inside, zt, 0.0)[None], inside.to(f64)[None]])  # (9, B, T)
        parts = [torch.empty_like(mine) for _ in range(n)]
        dist.all_gather(parts, mine, group=mesh.get_group())
        keys = merge_row_parts([p[:7] for p in parts])
        has = sum(p[8] for p in parts)
        target_logit = torch.where(has > 0, sum(p[7] for p in parts), float("nan"))
        rows = finish(keys, kept.to(z.device), target_logit=target_logit, n_max=v)
        if isinstance(hidden, DTensor):
            hidden = hidden.full_tensor()
        lm_head_factors(rows, keys, hidden, stats.dtype)
        stats.accumulator.add_rows(SiteGroup(vocab.LM_HEAD, -1), rows, head_dim=None)


class RankFailed(Exception):
    """Some ranks' statistics raised: ``failures`` maps each rank to its one-line error."""

    def __init__(self, failures: dict[int, str], traces: dict[int, str]) -> None:
        self.failures, self.traces = failures, traces
        super().__init__("; ".join(f"rank {r} raised {e}" for r, e in sorted(failures.items())))


@dataclass
class RankProbe:
    """What a distributed probe gave: the merged frame (rank 0; None elsewhere or when a rank
    failed), the failed ranks' one-line errors and tracebacks, and the all-reduces it ran."""

    frame: pd.DataFrame | None
    failures: dict[int, str] = field(default_factory=dict)
    traces: dict[int, str] = field(default_factory=dict)
    all_reduces: int = 0
    template: _Local | None = None  # this rank's layout, empty (for ``probe_ranks``)


@dataclass
class _Local:
    """One rank's share before the merge: its accumulator, the per-layer query-key geometry
    sums (layer -> ((H_local, S), scaling)) and role sums and counts (layer -> (H_local, R) x 2),
    the unembedding's (sum of row norms, rows) this rank counts (``hooks.engine.unembed_sums``)
    and the heads' ``qk_spectral_norm`` (layer -> (H_local, 2), ``hooks.engine.qk_spectral_part``)."""

    acc: Accumulator
    geometry: dict = field(default_factory=dict)
    roles: dict = field(default_factory=dict)
    unembed: tuple[float, int] = (0.0, 0)
    spectral: dict = field(default_factory=dict)

    def zeros(self) -> _Local:
        """The same layout holding nothing (a failed rank's contribution)."""
        return _Local(zeros_like(self.acc),
                      {k: (torch.zeros_like(g), c) for k, (g, c) in self.geometry.items()},
                      {k: (torch.zeros_like(a), torch.zeros_like(b)) for k, (a, b) in self.roles.items()},
                      spectral={k: torch.zeros_like(t) for k, t in self.spectral.items()})


def _unembed_share(model, layout: Layout) -> tuple[float, int]:
    """(sum of row norms, rows) of the unembedding rows this rank counts: its own rows of a
    weight sharded on the vocabulary (FSDP2, a vocab-parallel head), all of a whole weight on
    rank 0 only."""
    from torch.distributed.tensor import DTensor, Shard

    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is None:
        return 0.0, 0
    w = head.weight
    if isinstance(w, DTensor):
        if any(isinstance(p, Shard) and p.dim == 0 for p in w.placements):
            return unembed_sums(w.to_local())  # whole rows, disjoint over the ranks
        w = w.full_tensor()  # a collective: every rank reaches it
    return unembed_sums(w) if layout.rank == 0 else (0.0, 0)


def _local_probe(model, data: EvalData, config: SweepConfig, layout: Layout, forward) -> tuple[_Local, _Guard | None, BaseException | None]:
    """This rank's share over its batches (guarded statistics), and its error if any."""
    hf = forward is None and uses_attention_interface(model)
    batches, pad = rank_batches(data, config.batch_size, layout)
    guard = None
    try:
        check_model(model, data, type(model).__name__)
        with (attach(model, config.probe) if hf else attach_sdpa(model, config.probe)) as probe:
            stats = probe.stats
            guard = _Guard(stats)
            run = (lambda b: probe.run_batch(*b)) if hf else (lambda b: probe.run_batch(*b, forward=forward))
            for batch in batches:
                run(batch)
            kept = stats.snapshot()
            for _ in range(pad):  # FSDP2: the forward is collective; these statistics are dropped
                stats.restore((Accumulator(), {}))
                run(next(iter(data.batches(config.batch_size))))
                if not kept[0].groups():
                    kept = (zeros_like(stats.accumulator),
                            {k: (torch.zeros_like(g), c) for k, (g, c) in stats.geometry_parts.items()})
            stats.restore(kept)
            if hf:  # head roles: every rank runs the diagnostic batch, one data-parallel copy counts
                probe.run_roles()
            local = _Local(stats.accumulator, dict(stats.geometry_parts), dict(stats.role_parts),
                           _unembed_share(model, layout) if hf else (0.0, 0), dict(stats.spectral_parts))
            if layout.dp_rank != 0:  # a replica of what data-parallel rank 0 counts
                local.roles = {k: (torch.zeros_like(a), torch.zeros_like(b)) for k, (a, b) in local.roles.items()}
                local.spectral = {k: torch.zeros_like(t) for k, t in local.spectral.items()}
        return local, guard, guard.error
    except Exception as exc:  # noqa: BLE001 - reported through the merge
        if guard is not None and guard.error is None:
            guard._fail(exc)
        if guard is None:
            return _Local(Accumulator()), guard, exc
        st = guard.stats
        return _Local(st.accumulator, dict(st.geometry_parts), dict(st.role_parts),
                      spectral=dict(st.spectral_parts)), guard, exc


@dataclass
class _Merged:
    """What one merge gave every rank: the accumulator, the failure flags (one per rank), the
    per-layer geometry, role and qk_spectral_norm tables, the unembedding's (sum of row norms, rows)."""

    acc: Accumulator
    failed: torch.Tensor
    geometry: dict
    roles: dict
    unembed: torch.Tensor
    spectral: dict


def _merge(local: _Local, failed: bool, layout: Layout, place, reduce) -> _Merged:
    """One SUM and one MAX all-reduce: the accumulator, and riding on its SUM the failure flags,
    the geometry, role and qk_spectral_norm tables and the unembedding's sums."""
    flags = torch.zeros(layout.world, dtype=torch.float64)
    flags[layout.rank] = float(failed)
    geo_slots, geo = pack_layers({k: g for k, (g, _) in local.geometry.items()}, place)
    role_slots, role = pack_layers({k: torch.cat([a, b], -1) for k, (a, b) in local.roles.items()}, place)
    spec_slots, spec = pack_layers(local.spectral, place)
    extra = torch.cat([flags, geo.cpu(), role.cpu(), spec.cpu(), torch.tensor(local.unembed, dtype=torch.float64)])
    acc, rest = reduce_accumulator(local.acc, reduce, place=place, extra=extra)
    rest = rest.cpu()
    flags, rest = rest[: layout.world], rest[layout.world :]
    geometry, rest = unpack_layers(geo_slots, rest)
    roles, rest = unpack_layers(role_slots, rest)
    spectral, rest = unpack_layers(spec_slots, rest)
    return _Merged(acc, flags, geometry, roles, rest, spectral)


def _merged_frame(m: _Merged, scaling: dict) -> pd.DataFrame:
    """The tidy frame of a merge: the accumulator's metrics, the role scores, the geometry
    (``scaling``: layer -> the logit scaling) and the unembedding norm."""
    frame = m.acc.to_frame().reset_index(drop=True)
    n_roles = len(vocab.ROLE_METRICS)
    rows = (role_rows({k: (t[:, :n_roles], t[:, n_roles:]) for k, t in m.roles.items()})
            + geometry_rows({k: (g, scaling[k]) for k, g in m.geometry.items()}) + spectral_rows(m.spectral))
    total, n = m.unembed.tolist()
    if n > 0:
        rows.append((vocab.LM_HEAD, -1, -1, vocab.UNEMBED_NORM, total / n, int(n)))
    if not rows:
        return frame
    frame = pd.concat([frame, pd.DataFrame(rows, columns=list(frame.columns))], ignore_index=True)
    return frame.sort_values(["site_kind", "layer", "head", "metric"], kind="stable").reset_index(drop=True)


def _said_failures(out: RankProbe, failed: torch.Tensor, error, guard, world: int) -> None:
    """Every rank's one-line error and traceback gathered (one collective) into ``out``."""
    said = f"{type(error).__name__}: {error}".splitlines()[0] if error is not None else ""
    every: list = [None] * world
    dist.all_gather_object(every, (said, guard.trace if guard is not None else ""))
    for r in torch.nonzero(failed).flatten().tolist():
        out.failures[r], out.traces[r] = every[r]


def probe_ranks(model: torch.nn.Module, data: EvalData, config: SweepConfig, layout: Layout, *,
                forward: Callable | None = None, timeout: float = DEFAULT_TIMEOUT,
                template: _Local | None = None) -> RankProbe:
    """Probe on every rank and merge (see the module doc); call on every rank at once.
    ``template``: an earlier probe's ``RankProbe.template``, the layout a failed rank whose
    forward stopped early contributes its zeros in."""
    model = unwrap(model)
    local, guard, error = _local_probe(model, data, config, layout, forward)
    if error is not None:
        local = (template if template is not None else local).zeros()
    heads = getattr(getattr(model, "config", None), "num_attention_heads", None)
    count = [0]
    reduce = _all_reduce(timeout)

    def counted(t: torch.Tensor, op: str) -> None:
        count[0] += 1
        reduce(t, op)

    merged = _merge(local, error is not None, layout, placement(layout, heads), counted)
    out = RankProbe(None, all_reduces=count[0], template=None if error is not None else local.zeros())
    if merged.failed.any():
        _said_failures(out, merged.failed, error, guard, layout.world)
        if isinstance(error, UnsupportedModelError):
            raise error  # every probe of this model would fail the same way
        return out
    if layout.rank != 0:
        return out
    frame = _merged_frame(merged, {k: c for k, (_, c) in local.geometry.items()})
    if config.attribution.active and not layout.sharded and forward is None and uses_attention_interface(model):
        subset = list(data.batches(config.batch_size, config.attribution.windows))  # (b, T) each
        extra = attribute(model, subset, heads=config.attribution.heads)
        frame = pd.concat([frame, extra], ignore_index=True)
        frame = frame.sort_values(["site_kind", "layer", "head", "metric"], kind="stable").reset_index(drop=True)
    out.frame = frame
    return out
