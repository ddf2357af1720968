"""The statistics of softmax calls, whatever model makes them: ``SiteStats``.

A hook (the Hugging Face attention interface in ``interface``, any model's
``F.scaled_dot_product_attention`` calls in ``sdpa``) hands each attention call's query and
key states and its masking here, and the final logits with their next-token targets; this
module picks the statistics path, reduces the call to per-site sums and accumulates them.

Paths for attention:
* the fused Triton kernel (``probes.triton_kernel``), backend "triton", and "auto" on CUDA:
  one launch per layer over per-row key ranges (``probes.ranges``), no host synchronisation; a
  mask the ranges cannot express is counted on the device and checked once per batch
  (``check_ranges``), and the batch is then probed again on the torch path;
* the torch path (``probes.attention``), the exact reference, backend "torch", and "auto" on
  CPU; ``fused`` also returns the attention output from the same exponentials.

A mixture-of-experts router's logits (tokens, experts) are reduced in one block per call
(``probes.router``). The LM head: on the kernel path one Triton pass over the model's own
logits in their dtype (``probes.triton_lm_head``); on the torch path block by block (never a
float copy of the whole logits tensor). Either keeps the batch's loss on the device until it
is asked for.
"""

from __future__ import annotations

import importlib.util

import torch

from .. import vocab
from ..config import ProbeConfig
from ..probes import (
    Accumulator,
    MaskSpec,
    SiteGroup,
    attention_forward_with_sums,
    attention_head_sums,
)
from ..probes.geometry import geometry_sums, geometry_values, qk_spectral_norms
from ..probes.ranges import key_ranges, ranges_mask, ranges_supported
from ..probes.roles import role_sums
from ..probes.router import router_row_stats
from ..probes.rows import RowStats, block_sums, finish, target_logit
from ..probes.sums import Sums
from ..probes.workspace import Workspace
from .qk_weights import qk_weights
from .routing import UnsupportedModelError

STATS_DTYPES = {"float32": torch.float32, "float64": torch.float64}
LM_BLOCK_ELEMENTS = 1 << 20  # elements of one block of LM-head logits at most (one row may exceed it)
CPU_CHUNK = 32  # query rows per attention block on CPU (the fastest there: benchmarks/throughput.py)
#: elements of one block of logits on a GPU (torch path and LM head): few large kernels, since
#: small blocks leave a GPU waiting on launches (docs/gpu.md)
GPU_BLOCK_ELEMENTS = 1 << 25


def block_rows(chunk: int | None, query: torch.Tensor, key: torch.Tensor) -> int:
    """Query rows per attention block on the torch path: ``chunk`` if given; else CPU_CHUNK on
    CPU, and on a GPU the largest power of two (at least CPU_CHUNK) whose (B, H, rows, Tk) block
    of logits stays within GPU_BLOCK_ELEMENTS."""
    if chunk is not None:
        return chunk
    if not query.is_cuda:
        return CPU_CHUNK
    return gpu_rows(query.shape[0], query.shape[1], key.shape[2])


def gpu_rows(batch: int, heads: int, keys: int, budget: int | None = None) -> int:
    """The largest power of two, at least CPU_CHUNK, with batch x heads x rows x keys <= budget
    (GPU_BLOCK_ELEMENTS by default)."""
    budget = GPU_BLOCK_ELEMENTS if budget is None else budget
    rows = max(1, budget // max(1, batch * heads * keys))
    return max(CPU_CHUNK, 1 << (rows.bit_length() - 1))


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def resolve_backend(backend: str, like: torch.Tensor) -> str:
    """The path a call on ``like``'s device takes: "auto" is the Triton kernel on CUDA when
    triton is installed and the torch path elsewhere."""
    if backend != "auto":
        return backend
    return "triton" if like.is_cuda and triton_available() else "torch"


def lm_targets(input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
               position_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows kept (B, T) bool, next-token target (B, T) int64, -1 where none): the next token
    when both positions are real tokens of the same document (``position_ids`` restarting at 0
    mark packed documents' starts)."""
    mask = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
    nxt_ok = mask[:, 1:] & mask[:, :-1]
    if position_ids is not None and position_ids.shape[-1] == input_ids.shape[-1]:
        nxt_ok = nxt_ok & (position_ids.expand_as(input_ids)[:, 1:] != 0)
    target = torch.full_like(input_ids, -1)
    target[:, :-1] = torch.where(nxt_ok, input_ids[:, 1:], torch.full_like(input_ids[:, 1:], -1))
    return mask, target


def lm_head_factors(stats: RowStats, keys: Sums, hidden: torch.Tensor | None, dtype: torch.dtype) -> None:
    """Add the LM head's growth factors to its per-position ``stats``: log Z from the softmax
    sums, and the norm of the ``hidden`` states (B, T, D) the head read, where given."""
    okf = stats.weight[vocab.ENTROPY]  # (B, T) 1 on kept rows
    zero = torch.zeros((), dtype=okf.dtype, device=okf.device)
    lse = keys.m + keys.s.clamp(min=1e-300).log()  # (B, T) log Z
    stats.values[vocab.LOG_Z] = torch.where(okf > 0, lse.to(okf.dtype), zero)
    stats.weight[vocab.LOG_Z] = okf
    if hidden is not None and tuple(hidden.shape[:2]) == tuple(okf.shape):
        norm = hidden.detach().to(dtype).norm(dim=-1).to(okf.dtype).to(okf.device)
        stats.values[vocab.HIDDEN_NORM] = torch.where(okf > 0, norm, zero)
        stats.weight[vocab.HIDDEN_NORM] = okf


def geometry_rows(parts: dict[int, tuple[torch.Tensor, float]]) -> list[tuple]:
    """(site_kind, layer, head, metric, value, n_rows) of every head's geometry, from the
    per-layer (H, S) geometry sums and the layer's logit scaling."""
    rows = []
    for layer, (sums, scaling) in sorted(parts.items()):
        for name, (v, n) in geometry_values(sums, scaling).items():
            for head, (x, c) in enumerate(zip(v.cpu().tolist(), n.cpu().tolist(), strict=True)):
                rows.append((vocab.ATTN, layer, head, name, x, int(c)))
    return rows


def qk_spectral_part(module: torch.nn.Module, heads: int, head_dim: int, scaling: float) -> torch.Tensor:
    """(H, 2) float64, per head (scaling * ||W_Q,h^T W_K,h||_2, 1), or (0, 0) for every head
    where the module's layout is not read (``qk_weights``): a per-head sum and count, so the
    distributed merge adds it like the other per-head tables. Left on the weights' device: no
    host copy inside the forward."""
    w = qk_weights(module, heads, head_dim)
    if w is None:
        return torch.zeros(heads, 2, dtype=torch.float64)
    norms = scaling * qk_spectral_norms(*w)  # (H,)
    return torch.stack([norms, torch.ones_like(norms)], -1)


def spectral_rows(parts: dict[int, torch.Tensor]) -> list[tuple]:
    """(site_kind, layer, head, metric, value, n_rows) of every head whose ``vocab.QK_SPECTRAL``
    was read, from the per-layer (H, 2) sums and counts (``qk_spectral_part``)."""
    rows = []
    for layer, part in sorted(parts.items()):
        for head, (total, n) in enumerate(part.cpu().tolist()):
            if n > 0:
                rows.append((vocab.ATTN, layer, head, vocab.QK_SPECTRAL, total / n, int(n)))
    return rows


def role_rows(parts: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> list[tuple]:
    """(site_kind, layer, head, metric, value, n_rows) of every role score, from the per-layer
    (H, R) role sums and counts."""
    rows = []
    for layer, (sums, counts) in sorted(parts.items()):
        s, c = sums.cpu().tolist(), counts.cpu().tolist()
        for head in range(len(s)):
            for j, name in enumerate(vocab.ROLE_METRICS):
                n = c[head][j]
                rows.append((vocab.ATTN, layer, head, name, s[head][j] / n if n else float("nan"), int(n)))
    return rows


def unembed_sums(weight: torch.Tensor) -> tuple[float, int]:
    """(sum of the unembedding's row norms in float64, rows) of a (V, D) weight: the LM head's
    ``vocab.UNEMBED_NORM`` is their ratio (sums, so vocabulary shards add up)."""
    w = weight.detach()
    return float(w.to(torch.float64).norm(dim=-1).sum()), int(w.shape[0])


class SiteStats:
    """Accumulates the statistics of every softmax call handed to it (``attention``,
    ``lm_head``), on the path ``config`` asks for."""

    def __init__(self, config: ProbeConfig):
        self.config = config
        self.accumulator = Accumulator()
        self.work = Workspace()  # block-sized scratch, reused from block to block
        self.dtype = STATS_DTYPES[config.dtype]
        if config.backend == "triton" and not triton_available():
            raise UnsupportedModelError("backend 'triton' needs the triton package (pip install triton)")
        self._broken: list[torch.Tensor] = []  # per kernel call: rows its ranges misrepresent
        self._loss: list[torch.Tensor] = []  # per LM-head call: (sum, count) on the device
        #: set while the diagnostic batch runs (``interface.Probe.run_roles``): (R, T) role targets
        self.role_targets: torch.Tensor | None = None
        self.role_parts: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # layer -> (H, R) x 2
        self.geometry_parts: dict[int, tuple[torch.Tensor, float]] = {}  # layer -> (H, S), scaling
        #: layer -> (H, 2) ``qk_spectral_part``: a weight figure, read at the layer's first call
        self.spectral_parts: dict[int, torch.Tensor] = {}

    # -- attention ---------------------------------------------------------------------------
    def _kernel(self, query, key, spec: MaskSpec, kw: dict) -> bool:
        if resolve_backend(self.config.backend, query) != "triton" or self.config.fused:
            return False
        from ..probes.triton_kernel import kernel_supported

        return (ranges_supported(spec, query.shape[1])
                and kernel_supported(query, key, position_bias=kw.get("position_bias"), dtype=self.dtype))

    def attention(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor | None,
                  *, spec: MaskSpec, scaling: float, softcap: float | None = None,
                  sinks: torch.Tensor | None = None, position_bias: torch.Tensor | None = None,
                  row_valid: torch.Tensor | None = None, doc_start: torch.Tensor | None = None,
                  want_output: bool = False, module: torch.nn.Module | None = None) -> torch.Tensor | None:
        """Add the statistics of one attention call to layer ``layer``'s sites: query
        (B, H, Tq, D), key (B, Hkv, Tk, D); ``doc_start`` (B|1, Tq) the first key of each row's
        document (packed documents without a mask tensor). With ``want_output`` (and
        ``config.fused``) returns the attention output (B, Tq, H, Dv) computed from the probe's
        own scores, else None. ``module``: the attention module making the call, whose
        projection weights give the layer's ``vocab.QK_SPECTRAL`` once per probe."""
        query, key = query.detach(), key.detach()
        if module is not None and layer not in self.spectral_parts:
            self.spectral_parts[layer] = qk_spectral_part(module, query.shape[1], query.shape[-1], scaling)
        if self.role_targets is not None:  # the diagnostic batch: role scores only
            self._roles(layer, query, key, spec, scaling, softcap, sinks, position_bias)
            return None
        self._geometry(layer, query, key, spec, scaling, row_valid, doc_start)
        b, h, tq, _ = query.shape
        tk = key.shape[2]
        kw = {"scaling": scaling, "softcap": softcap, "sinks": sinks, "position_bias": position_bias}
        if self._kernel(query, key, spec, kw):
            from ..probes.triton_kernel import kernel_site_sums

            r = key_ranges(spec, b, tq, tk, query.device, doc_start)
            self._broken.append(r.broken)
            site = kernel_site_sums(query, key, scaling=scaling, start=r.start, end=r.end,
                                    row_valid=row_valid, softcap=softcap, sinks=sinks)
            self.accumulator.add(SiteGroup(vocab.ATTN, layer), site)
            return None
        if doc_start is not None:  # packed documents without a mask tensor: write their mask
            spec = MaskSpec(mask=ranges_mask(key_ranges(spec, b, tq, tk, query.device, doc_start), tk))
        torch_kw = dict(kw, mask=spec, row_valid=row_valid, chunk=block_rows(self.config.chunk, query, key),
                        dtype=self.dtype, work=self.work)
        out = None
        if want_output and self.config.fused and value is not None and not torch.is_grad_enabled():
            out, site = attention_forward_with_sums(query, key, value.detach(), **torch_kw)
        else:
            site = attention_head_sums(query, key, **torch_kw)
        self.accumulator.add(SiteGroup(vocab.ATTN, layer), site)
        return out

    def _roles(self, layer, query, key, spec, scaling, softcap, sinks, position_bias) -> None:
        """Add one attention call's role sums (torch path whatever the backend: the diagnostic
        batch is small)."""
        sums, counts = role_sums(query, key, self.role_targets, spec=spec, scaling=scaling,
                                 softcap=softcap, sinks=sinks, position_bias=position_bias,
                                 chunk=block_rows(self.config.chunk, query, key), dtype=self.dtype)
        old = self.role_parts.get(layer)
        self.role_parts[layer] = (sums, counts) if old is None else (old[0] + sums, old[1] + counts)

    def _geometry(self, layer, query, key, spec, scaling, row_valid, doc_start) -> None:
        """Add one call's query-key geometry sums (``probes.geometry``; torch, whatever the
        statistics path)."""
        if doc_start is not None:
            b, _, tq, _ = query.shape
            spec = MaskSpec(mask=ranges_mask(key_ranges(spec, b, tq, key.shape[2], query.device, doc_start),
                                             key.shape[2]))
        sums = geometry_sums(query, key, spec=spec, row_valid=row_valid,
                             chunk=block_rows(self.config.chunk, query, key), dtype=self.dtype)
        old = self.geometry_parts.get(layer)
        self.geometry_parts[layer] = (sums if old is None else old[0] + sums.to(old[0].device), scaling)

    def snapshot(self) -> tuple:
        """What the statistics hold now (the geometry sums' tensors are replaced, never changed
        in place, so a shallow copy of their table is enough), for ``restore``."""
        return self.accumulator.copy(), dict(self.geometry_parts)

    def restore(self, snapshot: tuple) -> None:
        """Forget everything added since ``snapshot`` was taken."""
        accumulator, parts = snapshot
        self.accumulator, self.geometry_parts = accumulator, dict(parts)

    def geometry_rows(self) -> list[tuple]:
        """(site_kind, layer, head, metric, value, n_rows) of every head's geometry, the weight
        figure ``vocab.QK_SPECTRAL`` included."""
        return geometry_rows(self.geometry_parts) + spectral_rows(self.spectral_parts)

    def role_rows(self) -> list[tuple]:
        """(site_kind, layer, head, metric, value, n_rows) of every role score measured."""
        return role_rows(self.role_parts)

    def ranges_broken(self) -> int:
        """Rows, since the last call, whose mask the kernel's key ranges could not express (one
        device-to-host copy); the caller probes that batch again on the torch path."""
        if not self._broken:
            return 0
        n = int(torch.stack([x.to(self._broken[0].device) for x in self._broken]).sum())
        self._broken.clear()
        return n

    # -- the LM head ---------------------------------------------------------------------------
    def _lm_kernel(self, logits: torch.Tensor) -> bool:
        if resolve_backend(self.config.backend, logits) != "triton":
            return False
        from ..probes.triton_lm_head import lm_head_supported

        return lm_head_supported(logits, self.dtype)

    def lm_head(self, logits: torch.Tensor, kept: torch.Tensor, target: torch.Tensor,
                hidden: torch.Tensor | None = None) -> None:
        """Add the LM head's statistics of ``logits`` (B, T, V) over the kept positions (B, T)
        against the next-token ``target`` (B, T; -1 none): on the kernel path from one pass
        over the logits in their own dtype (``probes.triton_lm_head``), else block by block in
        the statistics dtype, with the mean log Z and, given the ``hidden`` states (B, T, D) the LM
        head read, their mean norm; the batch's loss sum and count stay on the device."""
        v = logits.shape[-1]
        target = target.to(logits.device)
        with torch.no_grad():
            if self._lm_kernel(logits):
                from ..probes.triton_lm_head import lm_head_sums

                keys, zt = lm_head_sums(logits.detach(), target)
            else:
                keys, zt = self._lm_head_blocks(logits, target)
            stats = finish(keys, kept.to(logits.device), target_logit=zt, n_max=v)
            lm_head_factors(stats, keys, hidden, self.dtype)
            self.accumulator.add_rows(SiteGroup(vocab.LM_HEAD, -1), stats, head_dim=None)
            w = stats.weight[vocab.LOSS]
            self._loss.append(torch.stack([(stats.values[vocab.LOSS] * w).sum(), w.sum()]))

    def _lm_head_blocks(self, logits: torch.Tensor, target: torch.Tensor) -> tuple[Sums, torch.Tensor]:
        """The torch path's (``Sums`` (B, T), target logit (B, T)): block by block of positions,
        each a copy of the logits in the statistics dtype."""
        b, t, v = logits.shape
        # Positions per block: at most lm_chunk, and few enough that one (B, C, V) temporary
        # stays within the block budget whatever the vocabulary (the size of the attention
        # blocks, so both reuse the same workspace buffers instead of growing them).
        budget = GPU_BLOCK_ELEMENTS if logits.is_cuda else LM_BLOCK_ELEMENTS
        step = max(1, min(self.config.lm_chunk, budget // max(1, b * v)))
        parts: list[Sums] = []  # per block of positions: (B, C) sums over the vocabulary
        targets = []
        valid = torch.ones(1, 1, v, dtype=torch.bool, device=logits.device)
        for t0 in range(0, t, step):
            z = logits[:, t0 : t0 + step].detach().to(self.dtype)  # (B, C, V)
            parts.append(block_sums(z, work=self.work))
            targets.append(target_logit(z, valid, target[:, t0 : t0 + step]))
        # every position's statistics at once: few large per-row operations, not many small
        keys = Sums(*(torch.cat([getattr(p, f) for p in parts], 1) for f in Sums.__dataclass_fields__))
        return keys, torch.cat(targets, 1)

    def end_batch(self) -> tuple[int, float]:
        """(rows whose mask the kernel's key ranges misread, the mean next-token loss) of the
        calls since the last call, from one device-to-host copy (NaN loss without an LM-head
        call)."""
        if not self._broken and not self._loss:
            return 0, float("nan")
        like = (self._loss or self._broken)[0]
        broken = (torch.stack([x.to(like.device) for x in self._broken]).sum().to(torch.float64).view(1)
                  if self._broken else torch.zeros(1, dtype=torch.float64, device=like.device))
        loss = (torch.stack(self._loss).sum(0).to(torch.float64) if self._loss
                else torch.zeros(2, dtype=torch.float64, device=like.device))
        n_broken, total, n = torch.cat([broken, loss.to(broken.device)]).tolist()
        self._broken.clear()
        self._loss.clear()
        return int(n_broken), (total / n if n else float("nan"))

    # -- MoE routers ----------------------------------------------------------------------------
    def router(self, layer: int, logits: torch.Tensor, kept: torch.Tensor, top_k: int) -> None:
        """Add router ``layer``'s statistics of ``logits`` (N tokens, E experts) over the ``kept``
        (N,) tokens, with its top-k (reduced in the statistics dtype; E is small)."""
        with torch.no_grad():
            stats, load = router_row_stats(logits, kept, top_k, self.dtype)
            self.accumulator.add_rows(SiteGroup(vocab.ROUTER, layer), stats, head_dim=None, load=load)

    def loss(self) -> float:
        """The mean next-token loss of the LM-head calls since the last call (NaN without one;
        one device-to-host copy)."""
        if not self._loss:
            return float("nan")
        total, n = torch.stack(self._loss).sum(0).tolist()
        self._loss.clear()
        return total / n if n else float("nan")

    def clear(self) -> None:
        self.work.clear()

