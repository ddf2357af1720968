"""Head roles on planted heads: a GPT-2 built by hand with one previous-token head (layer 0),
one sink head (layer 0) and one induction head (layer 1, reading the previous-token head's
output); every other head attends uniformly. Each planted head gets its role, no other head
gets one. The scores are also checked against an eager float64 reference."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from peakprobe import vocab
from peakprobe.config import ProbeConfig
from peakprobe.hooks import attach
from peakprobe.probes.roles import diagnostic_batch, role_targets
from peakprobe.reports.roles import head_roles

V, P, HD = 32, 32, 32  # vocabulary, positions, head dim
D = 2 * V + P  # residual: token one-hot, position one-hot, previous-token one-hot
TOK, POS, PREV = 0, V, V + P


def _ln_scale(k: int) -> tuple[float, float]:
    """(mu, sigma) of a residual vector with k ones among D (what LayerNorm divides by)."""
    mu = k / D
    return mu, math.sqrt(k / D - mu * mu + 1e-5)


def planted_gpt2() -> GPT2LMHeadModel:
    cfg = GPT2Config(vocab_size=V, n_positions=P, n_embd=D, n_layer=2, n_head=3,
                     bos_token_id=1, eos_token_id=2, resid_pdrop=0, embd_pdrop=0, attn_pdrop=0)
    model = GPT2LMHeadModel(cfg).eval().double()
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        tr = model.transformer
        tr.wte.weight[:, TOK:TOK + V] = torch.eye(V, dtype=torch.float64)
        tr.wpe.weight[:, POS:POS + P] = torch.eye(P, dtype=torch.float64)
        for blk in tr.h:
            blk.ln_1.weight.fill_(1.0)
            blk.ln_2.weight.fill_(1.0)
        tr.ln_f.weight.fill_(1.0)
        w0, b0 = tr.h[0].attn.c_attn.weight, tr.h[0].attn.c_attn.bias  # (D, 3D): q | k | v
        mu0, s0 = _ln_scale(2)
        for p in range(P):  # head 0: previous token (query at p meets key p - 1)
            w0[POS + p, 0 * HD + p] = 5.0
            if p + 1 < P:
                w0[POS + p, D + 0 * HD + p + 1] = 1.0
        for t in range(V):  # head 0's value: its key's token, written to the PREV block
            w0[TOK + t, 2 * D + 0 * HD + t] = 1.0
            tr.h[0].attn.c_proj.weight[0 * HD + t, PREV + t] = s0
        w0[POS + 0, D + 1 * HD + 0] = 1.0  # head 1: sink (a constant query meets key 0)
        b0.copy_(mu0 / s0 * w0.sum(0))  # LayerNorm's shift undone: projections of x / sigma
        b0[1 * HD + 0] += 30.0
        w1, b1 = tr.h[1].attn.c_attn.weight, tr.h[1].attn.c_attn.bias
        mu1, s1 = _ln_scale(3)
        for t in range(V):  # layer 1 head 0: induction (current token meets previous token)
            w1[TOK + t, 0 * HD + t] = 5.0
            w1[PREV + t, D + 0 * HD + t] = 1.0
        b1.copy_(mu1 / s1 * w1.sum(0))
    return model


PLANTED = {(0, 0): "previous-token", (0, 1): "sink", (1, 0): "induction"}


def _frame(model, ids, n) -> pd.DataFrame:
    with attach(model, ProbeConfig(dtype="float64")) as probe:
        probe.run_batch(ids)
        probe.run_roles(ids, n)
        return probe.to_frame()


def test_planted_heads_get_their_roles_and_no_other_head_does():
    model = planted_gpt2()
    ids, n = diagnostic_batch(V, P)
    frame = _frame(model, ids, n).assign(step=0)
    roles = head_roles(frame).set_index(["layer", "head"])
    assert len(roles) == 6
    for (layer, head), r in roles.iterrows():
        assert r["role"] == PLANTED.get((layer, head), ""), (layer, head, r.to_dict())
        if (layer, head) in PLANTED:
            assert r["role_score"] > 0.8 and r["role_step"] == 0


def test_role_scores_exact_against_eager_float64():
    model = planted_gpt2()
    ids, n = diagnostic_batch(V, P)
    frame = _frame(model, ids, n).set_index(["layer", "head", "metric"])["value"]
    with torch.no_grad():
        att = model(input_ids=ids, output_attentions=True, attn_implementation="eager").attentions
    tgt = role_targets(ids.shape[1], n).numpy()
    for layer, a in enumerate(att):
        a = a.double().numpy()  # (B, H, T, T)
        for j, name in enumerate(vocab.ROLE_METRICS):
            rows = np.flatnonzero(tgt[j] >= 0)
            want = a[:, :, rows, tgt[j][rows]].mean(axis=(0, 2))  # (H,)
            for head, v in enumerate(want):
                assert frame[(layer, head, name)] == pytest.approx(v, rel=1e-9, abs=1e-12)


def test_emergence_is_the_first_step_that_stays_above():
    rows = []
    for step, v in zip([0, 10, 20, 30, 40], [0.1, 0.5, 0.2, 0.6, 0.7], strict=True):
        rows.append({"step": step, "site_kind": vocab.ATTN, "layer": 0, "head": 0,
                     "metric": vocab.INDUCTION_SCORE, "value": v})
        rows.append({"step": step, "site_kind": vocab.ATTN, "layer": 0, "head": 0,
                     "metric": vocab.PREV_TOKEN_SCORE, "value": 0.3})
    r = head_roles(pd.DataFrame(rows)).iloc[0]
    assert (r["role"], r["role_step"], r["role_score"]) == ("induction", 30, 0.7)
