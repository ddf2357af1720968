"""The query-key geometry of attention heads: why the logits grow (pure torch).

Per head, over the rows and their visible keys (causal / window structure and the model's mask;
padding query rows left out), block by block (query rows x keys, never T x T), the float64 sums
``GEOMETRY_SUMS``; ``geometry_values`` turns merged sums into ``vocab.GEOMETRY_METRICS``.
With u = q . k over visible pairs and N the number of pairs,

    logit_rms = scaling * sqrt(sum u^2 / N)
              = scaling * q_rms * k_rms * qk_align,   q_rms = sqrt(sum_pairs |q|^2 / N),
                k_rms = sqrt(sum_pairs |k|^2 / N),    qk_align = sqrt(sum u^2 / N) / (q_rms k_rms),

exactly, so the growth exponents of the three factors add up to that of the RMS logit. The
logit here is scaling * q . k (softcapping and additive biases are not part of it).

``qk_spectral_norms`` is the weight figure ``vocab.QK_SPECTRAL``: per head the largest singular
value of W_Q,h^T W_K,h, from the projection weights alone (no data).
"""

from __future__ import annotations

import math

import torch

from .. import vocab
from .attention import MaskSpec, _chunk_logits, _index_valid

#: the per-head sums, in order: rows, pairs, sum_rows |q|, sum_pairs |k|, sum_pairs cos,
#: sum_pairs |q|^2, sum_pairs |k|^2, sum_pairs u^2
GEOMETRY_SUMS = ("rows", "pairs", "q", "k", "cos", "q2", "k2", "u2")


def geometry_sums(query: torch.Tensor, key: torch.Tensor, *, spec: MaskSpec,
                  row_valid: torch.Tensor | None = None, chunk: int = 32,
                  dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """(H, len(GEOMETRY_SUMS)) float64 sums of one attention call: query (B, H, Tq, D), key
    (B, Hkv, Tk, D), ``row_valid`` (B, Tq) bool or None."""
    b, h, tq, _ = query.shape
    tk = key.shape[2]
    g = h // key.shape[1]
    k = key.to(dtype)
    kn = k.norm(dim=-1).repeat_interleave(g, 1).unsqueeze(2)  # (B, H, 1, Tk)
    out = torch.zeros(h, len(GEOMETRY_SUMS), dtype=torch.float64, device=query.device)
    for i0 in range(0, tq, chunk):
        i1 = min(tq, i0 + chunk)
        q = query[:, :, i0:i1].to(dtype)  # (B, H, C, D)
        u = _chunk_logits(q, k, 1.0, None)  # (B, H, C, Tk)
        valid = _index_valid(spec, i0, i1, 0, tk, u.device)  # (1, 1, C, Tk)
        if spec.mask is not None:
            m = spec.mask[..., i0:i1, :]
            valid = valid & (m if m.dtype == torch.bool else m > torch.finfo(m.dtype).min / 2)
        if row_valid is not None:
            valid = valid & row_valid[:, i0:i1].view(b, 1, -1, 1).to(u.device)
        w = valid.expand_as(u).to(dtype)  # (B, H, C, Tk) 1 on visible pairs
        qn = q.norm(dim=-1)  # (B, H, C)
        n = w.sum(-1)  # (B, H, C) visible keys per row
        row = (n > 0).to(dtype)
        denom = (qn.unsqueeze(-1) * kn).clamp_min(torch.finfo(dtype).tiny)
        parts = (row, n, row * qn, (w * kn).sum(-1), (w * u / denom).sum(-1), n * qn * qn,
                 (w * kn * kn).sum(-1), (w * u * u).sum(-1))
        out += torch.stack([x.to(torch.float64).sum((0, 2)) for x in parts], -1)
    return out


def geometry_values(sums: torch.Tensor, scaling: float) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The pair metrics of ``vocab.GEOMETRY_METRICS`` (all but the weight figure ``QK_SPECTRAL``)
    of merged (H, len(GEOMETRY_SUMS)) sums: name -> (values (H,), rows each was taken over (H,))."""
    c = dict(zip(GEOMETRY_SUMS, sums.unbind(-1), strict=True))
    pairs = c["pairs"].clamp_min(1)
    q_rms, k_rms = (c["q2"] / pairs).sqrt(), (c["k2"] / pairs).sqrt()
    u_rms = (c["u2"] / pairs).sqrt()
    nan = torch.full_like(pairs, math.nan)
    ok = c["pairs"] > 0
    vals = {
        vocab.Q_NORM: (c["q"] / c["rows"].clamp_min(1), c["rows"]),
        vocab.K_NORM: (c["k"] / pairs, c["pairs"]),
        vocab.QK_COS: (c["cos"] / pairs, c["pairs"]),
        vocab.LOGIT_RMS: (scaling * u_rms, c["pairs"]),
        vocab.Q_RMS: (q_rms, c["pairs"]),
        vocab.K_RMS: (k_rms, c["pairs"]),
        vocab.QK_ALIGN: (u_rms / (q_rms * k_rms).clamp_min(torch.finfo(torch.float64).tiny), c["pairs"]),
    }
    return {name: (torch.where(ok, v, nan), n) for name, (v, n) in vals.items()}


def qk_spectral_norms(wq: torch.Tensor, wk: torch.Tensor) -> torch.Tensor:
    """(H,) float64 ||W_Q,h^T W_K,h||_2 per query head, on the weights' device (CPU for MPS,
    which has no float64): ``wq`` (H, d, D), ``wk`` (Hkv, d, D), head h reads key group
    h // (H / Hkv).

    The (D, D) product has rank <= d, so it is never formed: with the reduced QR factorisations
    W_Q,h^T = Q1 R1 and W_K,h^T = Q2 R2 (Q1, Q2 with orthonormal columns), W_Q,h^T W_K,h =
    Q1 (R1 R2^T) Q2^T and its spectral norm is that of the small R1 R2^T."""
    h, hkv = wq.shape[0], wk.shape[0]
    dev = torch.device("cpu") if wq.device.type == "mps" else wq.device
    a = wq.detach().to(dev, torch.float64).transpose(-1, -2)  # (H, D, d)
    b = wk.detach().to(dev, torch.float64).transpose(-1, -2)  # (Hkv, D, d)
    r1 = torch.linalg.qr(a, mode="r").R  # (H, min(D, d), d)
    r2 = torch.linalg.qr(b, mode="r").R.repeat_interleave(h // hkv, 0)  # (H, min(D, d), d)
    return torch.linalg.matrix_norm(r1 @ r2.transpose(-1, -2), ord=2)  # (H,)
