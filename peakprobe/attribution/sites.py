"""The searches of every softmax site: the LM head, each head, each layer and all attention.

``attribution_rows`` runs each site's search (``search``'s functions) on the loss evaluations of
a ``gains._Runner`` and returns the tidy rows. The searches run one after the other, or all in
lockstep (``lockstep``): every site's search is a thread of ``run_lockstep``, and each round's
pending evaluations, of every layer, head and group, run as a few batched forwards. A round's
attention evaluations are sorted by the lowest layer they change and cut into chunks of at most
``LOCKSTEP_LOGITS`` logits (all of a part's windows in one forward where they fit); each chunk
is one forward from its lowest layer up (the layers below answered from the beta = 1 cache), a
beta per (replica, layer, head). A replica runs the layers it leaves alone at beta = 1 the way
its one-by-one evaluation does (``beta.attention_with_beta``): the same path, on a larger
batch, so the two agree to that batch's rounding. The LM head's evaluations
need no forward: they read the cached logits. Last, the LM head is searched once more on the
logits of the model with every head at attention's best beta (``lm_after_attention``: one
forward per batch): its ``gain_after_attention``. docs/attribution.md, "Cost", counts them.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

import pandas as pd
import torch
from tqdm.auto import tqdm

from .. import vocab
from .lockstep import run_lockstep
from .runner import _Runner
from .search import SearchResult, minimize_log_beta, quadratic_estimate, screened_search

LM_SCAN = tuple(x / 2 for x in range(-6, 7))  # log beta -3 .. 3: the LM head's loss is cheap
GROUP_EVALS = 12  # loss evaluations at most per search
#: logits one batched lockstep forward may hold (replicas x rows x T x V): about a layer's heads
#: on a 1.4b-sized model with the default windows
LOCKSTEP_LOGITS = 2**29
LM = (vocab.LM_HEAD,)
ALL = (vocab.ATTN_ALL,)


def beta_vector(n: int, x: float, head: int | None, like: torch.Tensor) -> torch.Tensor:
    """(n,) betas: exp(x) at ``head`` and 1 elsewhere, or exp(x) everywhere (``head`` None)."""
    beta = torch.ones(n, dtype=like.dtype, device=like.device)  # (H,)
    value = torch.exp(torch.tensor(x, dtype=torch.float64)).item()
    if head is None:
        return beta * value
    beta[head] = value
    return beta


def _rows(kind: str, layer: int, head: int, r: SearchResult, n: int) -> list[tuple]:
    values = {vocab.SENSITIVITY: r.slope, vocab.CURVATURE: r.curvature, vocab.GAIN: r.gain,
              vocab.LOG_BETA_OPT: r.x}
    return [(kind, layer, head, m, float(values[m]), n) for m in vocab.ATTRIBUTION_METRICS]


class _Sites:
    """Every site's search as a job of (key, part_sum), part_sum(x, part) the part's loss sum with
    the key's beta at exp(x). Keys: ``LM``, (ATTN, layer, head), (ATTN_LAYER, layer), ``ALL``."""

    def __init__(self, run: _Runner, grads: dict[int, torch.Tensor], heads: str):
        self.run, self.grads, self.heads = run, grads, heads
        self.layers = sorted(grads)
        self.like = run.logits[0]
        self.f0 = run.loss0
        self.ftol = 4 * torch.finfo(self.like.dtype).eps * abs(self.f0)  # the loss's rounding noise
        self.g_lm, self.h_lm = run.lm_slopes()

    def keys(self) -> list[Hashable]:
        heads = [] if self.heads == "off" else [
            (vocab.ATTN, layer, h) for layer in self.layers for h in range(len(self.grads[layer]))]
        return [LM, *heads, *((vocab.ATTN_LAYER, layer) for layer in self.layers), ALL]

    def betas(self, key: Hashable, x: float) -> dict[int, torch.Tensor]:
        """The betas (layer -> (H,)) of an attention key's evaluation at x."""
        if key == ALL:
            return {i: beta_vector(len(self.grads[i]), x, None, self.like) for i in self.layers}
        layer = key[1]
        head = key[2] if key[0] == vocab.ATTN else None
        return {layer: beta_vector(len(self.grads[layer]), x, head, self.like)}

    def search(self, key: Hashable, part_sum: Callable[[float, int], float]) -> SearchResult:
        run = self.run

        def f(x: float) -> float:
            return sum(part_sum(x, k) for k in range(len(run.parts))) / run.n_tokens

        if key == LM:
            r = minimize_log_beta(f, self.f0, self.g_lm, ftol=self.ftol, scan=LM_SCAN)
            return SearchResult(r.x, r.f, self.f0, self.g_lm, self.h_lm, r.n_evals, r.at_bound, False)
        if key == ALL:
            g = float(sum(self.grads[i].sum() for i in self.layers))
            return minimize_log_beta(f, self.f0, g, ftol=self.ftol, max_evals=GROUP_EVALS)
        if key[0] == vocab.ATTN_LAYER:
            g = float(self.grads[key[1]].sum())
            return minimize_log_beta(f, self.f0, g, ftol=self.ftol, max_evals=GROUP_EVALS)
        return self._head(key[1], key[2], f, part_sum)

    def _head(self, layer: int, head: int, f: Callable[[float], float],
              part_sum: Callable[[float, int], float]) -> SearchResult:
        slope = float(self.grads[layer][head])
        if self.heads == "search":
            return minimize_log_beta(f, self.f0, slope, ftol=self.ftol, max_evals=GROUP_EVALS)
        if self.heads == "screen":
            run = self.run
            g_first = run.part_grads[0].get(layer) if run.part_grads else None
            full, first = run.first_part(part_sum, 0.0 if g_first is None else float(g_first[head]))
            return screened_search(full, self.f0, slope, floor=vocab.HEAD_GAIN_FLOOR * abs(self.f0),
                                   ftol=self.ftol, max_evals=GROUP_EVALS, first=first)
        return quadratic_estimate(f, self.f0, slope)

    def lm_after_attention(self, lm: SearchResult, attention: SearchResult) -> SearchResult:
        """The LM head's search on the model with every head's beta at attention's optimum
        (``attention``, the all-heads search): one forward per batch for those logits, then the
        LM head's cached-logit search on them. Its f0 is that model's loss. Where attention's
        optimum is beta = 1 this is the LM head's own search (``lm``)."""
        if attention.x == 0.0:
            return lm
        run = self.run
        logits = run.logits_with(self.betas(ALL, attention.x))

        def f(x: float) -> float:
            return sum(run.lm_part_sum(x, k, logits) for k in range(len(run.parts))) / run.n_tokens

        f0 = f(0.0)
        g, h = run.lm_slopes(logits)
        r = minimize_log_beta(f, f0, g, ftol=self.ftol, scan=LM_SCAN)
        return SearchResult(r.x, r.f, f0, g, h, r.n_evals, r.at_bound, False)

    def part_sum(self, key: Hashable, x: float, part: int) -> float:
        """One evaluation on its own (the sequential path): an attention key re-runs the layers
        from the lowest it changes."""
        if key == LM:
            return self.run.lm_part_sum(x, part)
        betas = self.betas(key, x)
        return self.run.part_sum(betas, min(betas), part)

    def evaluate(self, part: int, requests) -> list[float]:
        """A lockstep round's evaluations on part ``part``: [(key, x), ...] -> the loss sums."""
        out: dict[int, float] = {}
        attention = []
        for i, (key, x) in enumerate(requests):
            if key == LM:
                out[i] = self.run.lm_part_sum(x, part)
            else:
                attention.append((i, self.betas(key, x)))
        attention.sort(key=lambda item: min(item[1]))  # a chunk's forward starts at its lowest layer
        cap, whole = self.run.replicas_per_forward(part, LOCKSTEP_LOGITS)
        for c in range(0, len(attention), cap):
            chunk = attention[c : c + cap]
            sums = self.run.replica_part_sums([betas for _, betas in chunk], part, whole)
            out.update(zip((i for i, _ in chunk), sums, strict=True))
        return [out[i] for i in range(len(requests))]


def attribution_rows(run: _Runner, grads: dict[int, torch.Tensor], *, heads: str, progress: bool,
                     desc: str, lockstep: bool = False) -> pd.DataFrame:
    """The attribution frame of every site (see ``gains.attribute``)."""
    sites = _Sites(run, grads, heads)
    keys = sites.keys()
    bar = tqdm(total=len(keys), desc=desc, leave=False, disable=not progress, unit="site")

    def job(key: Hashable, part_sum: Callable[[float, int], float]) -> SearchResult:
        result = sites.search(key, part_sum)
        bar.update(1)
        return result

    try:
        if lockstep:
            results = run_lockstep(keys, job, sites.evaluate)
        else:
            results = [job(key, lambda x, k, key=key: sites.part_sum(key, x, k)) for key in keys]
    finally:
        bar.close()
    n = run.n_tokens
    rows: list[tuple] = []
    for key, r in zip(keys, results, strict=True):
        if key == LM or key == ALL:
            rows += _rows(key[0], -1, -1, r, n)
        elif key[0] == vocab.ATTN_LAYER:
            rows += _rows(vocab.ATTN_LAYER, key[1], -1, r, n)
        else:
            rows += _rows(vocab.ATTN, key[1], key[2], r, n)
    rows.append((vocab.LM_HEAD, -1, -1, vocab.ATTRIBUTION_LOSS, float(run.loss0), n))
    after = sites.lm_after_attention(results[keys.index(LM)], results[keys.index(ALL)])
    rows.append((vocab.LM_HEAD, -1, -1, vocab.GAIN_AFTER_ATTENTION, float(after.gain), n))
    if heads == "off":
        rows += [(vocab.ATTN, layer, h, vocab.SENSITIVITY, float(v), n)
                 for layer in sites.layers for h, v in enumerate(grads[layer].tolist())]
    frame = pd.DataFrame(rows, columns=["site_kind", "layer", "head", "metric", "value", "n_rows"])
    return frame.sort_values(["site_kind", "layer", "head", "metric"], kind="stable").reset_index(drop=True)
