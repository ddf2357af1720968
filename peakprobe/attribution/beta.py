"""Attention with a per-head inverse temperature beta on the softmax logits.

beta multiplies a softmax's logits after scaling and softcapping, before the mask: the head's
attention becomes softmax(beta_h * z + mask). With a learned sink logit (gpt-oss passes it as
``s_aux``) the sink is one of that softmax's options, so beta multiplies it too:
softmax([beta_h * z + mask, beta_h * s_h]), the sink column dropped after the softmax.

``attention_with_beta`` picks the cheapest exact path. Without softcapping or a sink the logits
are linear in the query, so multiplying head h's query by beta_h and handing the call to the
model's own attention function (sdpa, flash, eager) gives softmax(beta_h * z + mask) exactly.
With softcapping or a sink it computes the eager formulation here (``beta_attention``). Both are
differentiable in beta, so one backward pass gives d loss / d log beta for every head. No
weights change.

``one_head`` runs the same call for one query head only (its key/value head sliced out, the
module seen with one key/value group): where only that head's beta differs from 1, the other
heads' outputs are those of beta = 1 and need not be computed again.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..probes.attention import MaskSpec


def mask_spec(query: torch.Tensor, key: torch.Tensor, module, attention_mask, kwargs: dict) -> MaskSpec:
    """The masking an attention call asks for, as ``MaskSpec`` (what the eager path applies)."""
    causal = kwargs.get("is_causal")
    causal = getattr(module, "is_causal", True) if causal is None else bool(causal)
    return MaskSpec(
        mask=attention_mask,
        causal=causal,
        sliding_window=kwargs.get("sliding_window"),
        q_offset=key.shape[2] - query.shape[2],
    )


def per_head(beta: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """beta (H,), or (B, H) for a beta per batch row, as a (1|B, H, 1, 1) factor in ``like``'s
    dtype and device."""
    return beta.to(like.dtype).view(-1 if beta.dim() == 2 else 1, beta.shape[-1], 1, 1)


def beta_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    beta: torch.Tensor,
    *,
    scaling: float,
    mask: MaskSpec,
    softcap: float | None = None,
    sink: torch.Tensor | None = None,
) -> torch.Tensor:
    """softmax(beta_h * z + mask [, beta_h * sink_h]) @ V per head; returns (B, Tq, H, Dv) like HF.

    query: (B, H, Tq, D); key/value: (B, Hkv, Tk, D); beta: (H,) or (B, H); sink: (H,) or None.
    """
    b, h, tq, _ = query.shape
    hkv, tk = key.shape[1], key.shape[2]
    k = key.repeat_interleave(h // hkv, dim=1)  # (B, H, Tk, D)
    v = value.repeat_interleave(h // hkv, dim=1)  # (B, H, Tk, Dv)
    z = torch.matmul(query, k.transpose(-1, -2)) * scaling  # (B, H, Tq, Tk)
    if softcap is not None:
        z = torch.tanh(z / softcap) * softcap
    bh = per_head(beta, z)  # (1|B, H, 1, 1)
    z = z * bh
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
    if sink is not None:
        s = (sink.to(z.dtype).view(1, h, 1, 1) * bh).expand(b, h, tq, 1)  # (B, H, Tq, 1)
        z = torch.cat([z, s], dim=-1)  # (B, H, Tq, Tk + 1)
    soft_dtype = torch.promote_types(z.dtype, torch.float32)
    p = torch.softmax(z, dim=-1, dtype=soft_dtype).to(query.dtype)  # (B, H, Tq, Tk [+1])
    if sink is not None:
        p = p[..., :tk]  # the sink's share goes nowhere
    out = torch.matmul(p, v)  # (B, H, Tq, Dv)
    return out.transpose(1, 2).contiguous()


def attention_with_beta(
    delegate: Callable,
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask,
    beta: torch.Tensor,
    **kwargs,
):
    """One attention call with head h's logits multiplied by ``beta[h]`` (beta: (H,), or (B, H)
    for a beta per batch row: the lockstep evaluations put each search's replica of the windows
    along the batch).

    ``delegate`` is the model's own attention function; it runs the call (with beta folded into
    the query) unless softcapping or a sink makes the logits non-linear in the query.
    Returns (output (B, Tq, H, Dv), None).
    """
    softcap = kwargs.get("softcap")
    sink = kwargs.get("s_aux")
    if softcap is None and sink is None:
        q = query * per_head(beta, query)  # (B, H, Tq, D)
        out = delegate(module, q, key, value, attention_mask, **kwargs)
        return out[0], None
    scaling = kwargs.get("scaling")
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    spec = mask_spec(query, key, module, attention_mask, kwargs)
    out = beta_attention(
        query, key, value, beta, scaling=float(scaling), mask=spec, softcap=softcap, sink=sink
    )
    if beta.dim() == 2:
        # rows at beta = 1 take the model's own call, as an evaluation of them alone would (the
        # eager path may round differently: e.g. a float32 softmax in a float64 model)
        own = delegate(module, query, key, value, attention_mask, **kwargs)[0]  # (B, Tq, H, Dv)
        at_one = (beta.to(query.device) == 1).all(-1).view(-1, 1, 1, 1)  # (B, 1, 1, 1)
        out = torch.where(at_one, own.to(out.dtype), out)
    return out, None


class OneGroup:
    """An attention module seen with one key/value group (a single head's call)."""

    num_key_value_groups = 1

    def __init__(self, module: torch.nn.Module):
        self._module = module

    def __getattr__(self, name: str):
        return getattr(self._module, name)


def real_module(module) -> torch.nn.Module:
    """The attention module itself, also when seen through ``OneGroup``."""
    return module._module if isinstance(module, OneGroup) else module


def one_head(
    delegate: Callable,
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask,
    head: int,
    beta: torch.Tensor,
    **kwargs,
) -> torch.Tensor | None:
    """Query head ``head``'s output alone, its logits times ``beta`` (a 0-d or (1,) tensor):
    (B, Tq, 1, Dv); None where the call carries a per-head tensor other than a sink (it could
    not be sliced safely). query: (B, H, Tq, D); key/value: (B, Hkv, Tk, D)."""
    n = query.shape[1]
    per_head = [t for t in (attention_mask, *kwargs.values())
                if isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[1] == n and n > 1]
    if per_head:
        return None
    kv = head // (n // key.shape[1])
    kw = dict(kwargs)
    if kw.get("s_aux") is not None:
        kw["s_aux"] = kw["s_aux"][head : head + 1]
    out, _ = attention_with_beta(
        delegate, OneGroup(module), query[:, head : head + 1], key[:, kv : kv + 1],
        value[:, kv : kv + 1], attention_mask, beta.reshape(1), **kw,
    )
    return out  # (B, Tq, 1, Dv)
