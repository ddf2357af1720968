"""Attention with a per-head inverse temperature, for the sensitivity probe.

The sensitivity of a softmax site is d(loss)/d(log beta) at beta = 1, where beta multiplies that
softmax's logits (after scaling and softcapping, before the mask). This module computes an
attention output with such a beta in plain differentiable torch (the eager formulation), so one
backward pass gives the derivative for every head at once. No weights change.
"""

from __future__ import annotations

import torch

from ..probes.attention import MaskSpec


def beta_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    log_beta: torch.Tensor,
    *,
    scaling: float,
    mask: MaskSpec,
    softcap: float | None = None,
) -> torch.Tensor:
    """softmax(exp(log_beta_h) * z + mask) @ V per head; returns (B, Tq, H, D) like HF.

    query: (B, H, Tq, D); key/value: (B, Hkv, Tk, D); log_beta: (H,).
    """
    b, h, tq, _ = query.shape
    hkv, tk = key.shape[1], key.shape[2]
    k = key.repeat_interleave(h // hkv, dim=1)  # (B, H, Tk, D)
    v = value.repeat_interleave(h // hkv, dim=1)  # (B, H, Tk, Dv)
    z = torch.matmul(query, k.transpose(-1, -2)) * scaling  # (B, H, Tq, Tk)
    if softcap is not None:
        z = torch.tanh(z / softcap) * softcap
    z = z * torch.exp(log_beta).to(z.dtype).view(1, h, 1, 1)
    lowest = torch.finfo(z.dtype).min
    if mask.mask is None:
        qpos = torch.arange(tq, device=z.device).unsqueeze(-1) + mask.q_offset  # (Tq, 1)
        kpos = torch.arange(tk, device=z.device).unsqueeze(0)  # (1, Tk)
        allowed = torch.ones(tq, tk, dtype=torch.bool, device=z.device)
        if mask.causal:
            allowed = allowed & (kpos <= qpos)
        if mask.sliding_window is not None:
            allowed = allowed & (kpos > qpos - mask.sliding_window)
        z = z.masked_fill(~allowed, lowest)
    elif mask.mask.dtype == torch.bool:
        z = z.masked_fill(~mask.mask[:, :, :tq, :tk], lowest)
    else:
        z = z + mask.mask[:, :, :tq, :tk].to(z.dtype)
    soft_dtype = torch.promote_types(z.dtype, torch.float32)
    p = torch.softmax(z, dim=-1, dtype=soft_dtype).to(query.dtype)  # (B, H, Tq, Tk)
    out = torch.matmul(p, v)  # (B, H, Tq, Dv)
    return out.transpose(1, 2).contiguous()
