"""The loss evaluations of the attribution (``_Runner``): the tempered model on fixed windows,
held in two parts, with the beta = 1 cache (every decoder block's output and the logits) the
evaluations reuse; one setting at a time (``part_sum``, a single head's change spliced into its
layer's cached output) or many replicas in one batched forward (``replica_part_sums``); the LM
head's closed-form slopes and its losses on the cached logits. The searches that call them:
``sites``; the entry point: ``gains.attribute``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from .. import vocab
from .search import FirstPart
from .tempered import Tempered, cached_below, decoder_layers, outer_blocks, recording

#: (input_ids (B, T), attention_mask (B, T) or None[, position_ids (B, T) or None]): position
#: ids restarting at 0 mark packed documents (then the mask is None)
Batch = tuple[torch.Tensor, ...]


def _full(batch: Batch) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """A batch as (ids, mask, position ids)."""
    ids, mask, *rest = batch
    return ids, mask, (rest[0] if rest else None)


def _targets(ids: torch.Tensor, mask: torch.Tensor | None, pos: torch.Tensor | None = None) -> torch.Tensor:
    """Next-token targets (B, T-1), -100 where the token or its successor is padding, or where
    the successor starts another packed document."""
    tgt = ids[:, 1:].clone()
    ok = torch.ones_like(tgt, dtype=torch.bool)
    if mask is not None:
        ok = mask[:, 1:].bool() & mask[:, :-1].bool()
    if pos is not None:
        ok = ok & (pos.expand_as(ids)[:, 1:] != 0)
    return torch.where(ok, tgt, torch.full_like(tgt, -100))


def _ce_sum(logits: torch.Tensor, tgt: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """Sum over tokens of the cross-entropy of scale * logits (float64 accumulation)."""
    total = torch.zeros((), dtype=torch.float64, device=logits.device)
    for b in range(logits.shape[0]):  # one sequence at a time bounds the (T, V) temporaries
        z = logits[b, :-1]
        z = z.float() if z.dtype in (torch.float16, torch.bfloat16) else z  # (T-1, V)
        if scale != 1.0:
            z = z * scale
        ce = torch.nn.functional.cross_entropy(z, tgt[b], ignore_index=-100, reduction="none")
        total = total + ce.to(torch.float64).sum()
    return total


def _ce_rows(logits: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
    """Per-sequence sums of the next-token cross-entropy, float64 accumulation: (B,)."""
    z = logits[:, :-1]
    z = z.float() if z.dtype in (torch.float16, torch.bfloat16) else z  # (B, T-1, V)
    ce = torch.nn.functional.cross_entropy(z.reshape(-1, z.shape[-1]), tgt.reshape(-1),
                                           ignore_index=-100, reduction="none")
    return ce.view(tgt.shape).to(torch.float64).sum(1)


def _replicated(out, r: int):
    """A block's cached output with its batch repeated r times (tensors in tuples too)."""
    if isinstance(out, torch.Tensor):
        return out.repeat(r, *([1] * (out.dim() - 1)))
    if type(out) in (tuple, list):
        return type(out)(_replicated(o, r) for o in out)
    return out


def _cat(parts: Sequence):
    """Batches' tensors (or tuples of them: block outputs) joined along the batch; None stays."""
    first = parts[0]
    if len(parts) == 1 or first is None:
        return first
    if isinstance(first, torch.Tensor):
        return torch.cat(parts)
    if type(first) in (tuple, list):
        return type(first)(_cat([p[j] for p in parts]) for j in range(len(first)))
    return first


def _lm_closed_form(logits: Sequence[torch.Tensor], targets: Sequence[torch.Tensor]) -> tuple[float, float]:
    """LM head's d L / d log beta and d^2 L / d (log beta)^2 at beta = 1, token means."""
    g = h = n = 0.0
    for z_all, tgt_all in zip(logits, targets, strict=True):
        for z, tgt in zip(z_all[:, :-1], tgt_all, strict=True):
            ok = tgt >= 0
            z = z[ok].to(torch.float64)  # (n, V)
            p = torch.softmax(z, dim=-1)
            mean = (p * z).sum(-1)
            var = (p * z * z).sum(-1) - mean * mean
            slope = mean - z.gather(-1, tgt[ok].unsqueeze(-1)).squeeze(-1)
            g += slope.sum().item()
            h += (slope + var).sum().item()
            n += int(ok.sum())
    return g / n, h / n


def _halves(batches: Sequence[Batch]) -> list[list[Batch]]:
    """The windows of ``batches`` in two parts, the first ceil(N / 2) windows and the rest, each
    cut into batches no larger than the largest given; one part for a single window."""
    full = [_full(b) for b in batches]
    ids = torch.cat([i for i, _, _ in full])  # (N, T)
    mask = None if all(m is None for _, m, _ in full) else torch.cat(
        [torch.ones_like(i) if m is None else m for i, m, _ in full])
    pos = None if all(p is None for _, _, p in full) else torch.cat(
        [torch.arange(i.shape[1]).expand_as(i) if p is None else p.expand_as(i) for i, _, p in full])
    size, n = max(len(i) for i, _, _ in full), len(ids)
    cut = (n + 1) // 2 if n > 1 else n

    def rows(x, a, b):
        return None if x is None else x[a:b]

    return [[(ids[a : min(a + size, b)], rows(mask, a, min(a + size, b)), rows(pos, a, min(a + size, b)))
             for a in range(lo_, b, size)] for lo_, b in ((0, cut), (cut, n)) if b > lo_]


class _Runner:
    """Loss evaluations of the tempered model on fixed batches, with cached lower layers.

    The windows are held in two parts (``_halves``), so that a single head's screen can look at
    the first half alone (``part_sum``); every loss over all windows is the sum of the parts'
    sums, the same bits however it was reached."""

    def __init__(self, state: Tempered, batches: Sequence[Batch]):
        self.state = state
        self.model = state.model
        device = next(self.model.parameters()).device
        parts = _halves(batches)
        self.batches = [tuple(None if x is None else x.to(device) for x in batch)
                        for part in parts for batch in part]
        self.parts = [list(range(sum(map(len, parts[:k])), sum(map(len, parts[: k + 1]))))
                      for k in range(len(parts))]  # batch indices of each part
        self.targets = [_targets(*batch) for batch in self.batches]
        counts = [int((t >= 0).sum()) for t in self.targets]
        self.part_tokens = [sum(counts[b] for b in part) for part in self.parts]
        self.n_tokens = sum(self.part_tokens)
        if self.n_tokens == 0:
            raise vocab.PeakprobeError("the attribution windows hold no next-token targets")
        self.part_loss0: list[float] = []  # per part: the loss sum at beta = 1
        self.part_grads: list[dict[int, torch.Tensor]] = []  # per part: layer -> (H,) slope sums
        self.layers: list | None = None
        self.outputs: list[list] = []  # per batch, per layer: the block's output at beta = 1
        self.logits: list[torch.Tensor] = []  # per batch (B, T, V) at beta = 1
        self._block_outputs: list[dict[int, object]] = []  # per batch: id(block) -> output
        self.attn_outputs: list[dict[int, torch.Tensor]] = []  # per batch: layer -> (B, T, H, D)
        self._checked: list[dict[int, bool]] = []  # per batch: the one-head calls' check
        self.loss0 = float("nan")

    def _forward(self, ids, mask, pos=None):
        extra = {} if pos is None else {"position_ids": pos}
        return self.model(input_ids=ids, attention_mask=mask, use_cache=False, **extra).logits

    def _forward_from(self, b: int, start: int) -> torch.Tensor:
        """Batch ``b``'s logits (B, T, V) under the current betas, re-running layers ``start``..
        only (the blocks below answer from the beta = 1 cache where there is one)."""
        if self.layers is not None and start > 0:
            with cached_below(self.layers, self.outputs[b], start):
                return self._forward(*self.batches[b])
        return self._forward(*self.batches[b])

    def gradients(self) -> dict[int, torch.Tensor]:
        """d L / d log beta per layer, (H,) float64, by one backward pass per batch.

        Its forward runs at beta = 1 (log beta = 0 exactly), so it also records what ``base``
        needs: the logits, the loss and every candidate block's output (detached)."""
        params = [p for p in self.model.parameters() if p.requires_grad]
        for p in params:
            p.requires_grad_(False)
        blocks = outer_blocks(self.model)
        self.part_loss0, self.part_grads = [0.0] * len(self.parts), [{} for _ in self.parts]
        try:
            with torch.enable_grad():
                for k, part in enumerate(self.parts):
                    total = self.part_grads[k]
                    for b in part:
                        batch = self.batches[b]
                        self.state.log_betas, self.state.record = {}, {}
                        with recording(blocks) as outs:
                            logits = self._forward(*batch)
                        self.attn_outputs.append(self.state.record)
                        self.state.record = None
                        loss = _ce_sum(logits, self.targets[b])
                        layers = sorted(self.state.log_betas)
                        grads = torch.autograd.grad(
                            loss, [self.state.log_betas[i] for i in layers], allow_unused=True
                        )
                        for i, g in zip(layers, grads, strict=True):
                            lb = self.state.log_betas[i]
                            g = torch.zeros_like(lb) if g is None else g
                            g = g.detach().to(torch.float64).cpu()
                            total[i] = total[i] + g if i in total else g
                        self.logits.append(logits.detach())
                        self._block_outputs.append(outs)
                        self.part_loss0[k] += loss.item()
        finally:
            self.state.log_betas = self.state.record = None
            for p in params:
                p.requires_grad_(True)
        self.loss0 = sum(self.part_loss0) / self.n_tokens
        layers = sorted({i for grads in self.part_grads for i in grads})
        return {i: sum(grads[i] for grads in self.part_grads if i in grads) / self.n_tokens for i in layers}

    def base(self) -> None:
        """The beta = 1 cache: the gradient pass's logits and decoder block outputs, checked to
        reproduce the loss exactly; failing that, a no-grad pass, checked the same way; failing
        that too, every evaluation is a full forward."""
        self.layers = decoder_layers(self.model, self.state.attention_modules)
        recorded, self._block_outputs = self._block_outputs, []  # other lists' outputs go
        if self.logits and self.layers is not None:
            self.outputs = [[outs.get(id(b)) for b in self.layers] for outs in recorded]
            if self._cache_reproduces():
                return
        self._no_grad_base()

    def _cache_reproduces(self) -> bool:
        """Every block's output is there, and the top layer re-run on them gives loss0 exactly."""
        top = len(self.layers) - 1
        return not any(o is None for outs in self.outputs for o in outs) and self.loss({}, top) == self.loss0

    @torch.no_grad()
    def _no_grad_base(self) -> None:
        """Fill the cache and logits by a no-grad forward (the decoder blocks only), and check it."""
        self.logits, self.outputs, self.attn_outputs = [], [], []
        self.part_loss0 = [0.0] * len(self.parts)
        for k, part in enumerate(self.parts):
            for b in part:
                batch = self.batches[b]
                self.state.record = {} if self.layers is not None else None
                with recording(self.layers or []) as outs:
                    logits = self._forward(*batch)
                self.attn_outputs.append(self.state.record or {})
                self.state.record = None
                self.logits.append(logits)
                self.outputs.append([outs.get(id(blk)) for blk in self.layers or []])
                self.part_loss0[k] += _ce_sum(logits, self.targets[b]).item()
        self.loss0 = sum(self.part_loss0) / self.n_tokens
        if self.layers is not None and not self._cache_reproduces():
            self.layers, self.outputs = None, []

    def loss(self, betas: dict[int, torch.Tensor], start: int = 0) -> float:
        """Mean next-token loss over all windows with ``betas`` (layer -> (H,)), re-running
        layers ``start``.. only: the parts' sums added (see ``part_sum``)."""
        return sum(self.part_sum(betas, start, k) for k in range(len(self.parts))) / self.n_tokens

    @torch.no_grad()
    def part_sum(self, betas: dict[int, torch.Tensor], start: int, part: int) -> float:
        """The next-token loss summed over part ``part``'s tokens with ``betas``, re-running
        layers ``start``.. only. With one layer's beta and the beta = 1 cache, a beta that
        differs from 1 in one head only recomputes that head's attention at its layer
        (``Tempered._one_head_only``)."""
        self.state.betas = betas
        splice = self.layers is not None and len(betas) == 1
        while splice and len(self._checked) < len(self.batches):
            self._checked.append({})
        total = 0.0
        try:
            for b in self.parts[part]:
                if splice:
                    self.state.cached, self.state.checked = self.attn_outputs[b], self._checked[b]
                total += _ce_sum(self._forward_from(b, start), self.targets[b]).item()
        finally:
            self.state.betas, self.state.cached = {}, {}
        return total

    def replicas_per_forward(self, part: int, max_logits: int) -> tuple[int, bool]:
        """(replicas one batched forward may hold, whether they hold the part's windows whole):
        its logits within ``max_logits`` elements; one replica of one batch at least."""
        whole = sum(self.logits[b].numel() for b in self.parts[part])
        if whole <= max_logits:
            return max_logits // whole, True
        return max(1, max_logits // max(self.logits[b].numel() for b in self.parts[part])), False

    @torch.no_grad()
    def replica_part_sums(self, settings: Sequence[dict[int, torch.Tensor]], part: int,
                          whole: bool = False) -> list[float]:
        """Part ``part``'s loss sums for R settings of the betas at once (each layer -> (H,)):
        the windows replicated R times along the batch (replica r takes rows r * b .. (r + 1) * b
        - 1; ``whole``: the part's batches as one, else batch by batch), a beta per row and layer
        (1 where a setting leaves a layer alone), the layers below the lowest one set answered
        from the cache. One host copy."""
        r = len(settings)
        start = min(min(s) for s in settings)
        ones = {i: torch.ones_like(v) for s in settings for i, v in s.items()}  # layer -> (H,) of 1
        rows = {i: torch.stack([s.get(i, one) for s in settings]) for i, one in ones.items()}  # (R, H)
        totals = torch.zeros(r, dtype=torch.float64, device=self.logits[0].device)
        units = [self.parts[part]] if whole else [[b] for b in self.parts[part]]
        try:
            for unit in units:
                ids, mask, pos = (_cat([self.batches[b][j] for b in unit]) for j in range(3))
                tgt = torch.cat([self.targets[b] for b in unit])  # (b, T - 1)
                n = ids.shape[0]
                rep = [None if t is None else t.repeat(r, *([1] * (t.dim() - 1))) for t in (ids, mask, pos)]
                self.state.betas = {i: v.repeat_interleave(n, 0) for i, v in rows.items()}  # (R * b, H)
                if self.layers is not None and start > 0:
                    below = _replicated(_cat([self.outputs[b][start - 1] for b in unit]), r)  # input of ``start``
                    with cached_below(self.layers, [below] * start, start):
                        logits = self._forward(*rep)
                else:
                    logits = self._forward(*rep)
                totals += _ce_rows(logits, tgt.repeat(r, 1)).view(r, n).sum(1)
        finally:
            self.state.betas = {}
        return totals.tolist()

    def lm_slopes(self, logits: Sequence[torch.Tensor] | None = None) -> tuple[float, float]:
        """The LM head's d L / d log beta and d^2 L / d (log beta)^2 at beta = 1 (closed forms),
        on the cached logits or on ``logits`` (one per batch)."""
        return _lm_closed_form(self.logits if logits is None else logits, self.targets)

    @torch.no_grad()
    def lm_part_sum(self, x: float, part: int, logits: Sequence[torch.Tensor] | None = None) -> float:
        """Part ``part``'s loss sum with the LM head's logits times exp(x): the cached beta = 1
        logits, or ``logits`` (one (B, T, V) per batch, as ``logits_with`` gives)."""
        logits = self.logits if logits is None else logits
        scale = float(torch.exp(torch.tensor(x, dtype=torch.float64)))
        return sum(_ce_sum(logits[b], self.targets[b], scale).item() for b in self.parts[part])

    @torch.no_grad()
    def logits_with(self, betas: dict[int, torch.Tensor]) -> list[torch.Tensor]:
        """Every batch's logits (B, T, V) with ``betas`` (layer -> (H,)), the layers below the
        lowest one set answered from the cache: one forward per batch."""
        self.state.betas = betas
        try:
            return [self._forward_from(b, min(betas)) for b in range(len(self.batches))]
        finally:
            self.state.betas = {}

    def first_part(self, part_sum: Callable[[float, int], float],
                   slope0: float) -> tuple[Callable[[float], float], FirstPart | None]:
        """The loss over all windows at x, and the screen's look at the first part (None with
        one part); ``part_sum(x, k)`` is part k's loss sum at x, ``slope0`` the first part's
        slope sum. The full loss at an x the first part has seen reuses that part's sum."""
        sums: dict[float, float] = {}

        def part(x: float) -> float:
            sums[x] = part_sum(x, 0)
            return sums[x] / self.part_tokens[0]

        def full(x: float) -> float:
            if x not in sums:
                return sum(part_sum(x, k) for k in range(len(self.parts))) / self.n_tokens
            rest = sum(part_sum(x, k) for k in range(1, len(self.parts)))
            return (sums.pop(x) + rest) / self.n_tokens

        if len(self.parts) < 2 or min(self.part_tokens) == 0:
            return full, None
        n0 = self.part_tokens[0]
        return full, FirstPart(part, self.part_loss0[0] / n0, slope0 / n0, full)
