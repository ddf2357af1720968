"""What a live probe reports besides its parquet: summary scalars for a logger, and alarms.

Both work on one probe's tidy frame (the rows of ``checkpoints/step<N>.parquet``) and need
only pandas, so they can be tested, and reused, without a model.

Scalars (names are the logger's tags):

* ``peakprobe/loss`` — the LM-head loss on the fixed evaluation windows;
* ``peakprobe/lm_head/logit_std``, ``peakprobe/lm_head/entropy``;
* ``peakprobe/L<l>/logit_std_median``, ``peakprobe/L<l>/entropy_median`` — the median over the
  heads of layer ``l``;
* ``peakprobe/n_peaked_heads`` — heads peaked by the entropy-equivalent rule (their
  ``peaked_entropy`` row fraction, beta_eff > sqrt(2 ln n), is at least
  ``vocab.PEAKED_FRACTION``; the rule the bottleneck verdict uses), or by the logit-std flag
  ``peaked`` in a frame without ``peaked_entropy``;
* ``peakprobe/n_peaked_heads_logit_std`` — the same count by the logit-std flag (secondary);
* ``peakprobe/top/L<l>H<h>/logit_std`` — the ``vocab.MONITOR_TOP_HEADS`` heads of largest
  logit_std, peaked heads first (the heads the 1/3 law is about: concentrating on few keys);
* ``peakprobe/logit_max``, ``peakprobe/lm_head/logit_max`` — the largest attention logit over
  every head (what QK-clip bounds), and the LM head's.

Alarms compare a probe with the one before it (thresholds in ``vocab``):

* attention-entropy collapse: a head's ``entropy_norm`` drops below ``ENTROPY_COLLAPSE``;
* logit-std jump: a site's ``logit_std`` grows by more than ``LOGIT_STD_JUMP`` times (the
  Monitor checks this only between probes after the warmup, see ``Monitor``);
* max logit: a head's largest attention logit crosses ``logit_max_limit`` (default
  ``LOGIT_MAX_ALARM``, 100, MuonClip's threshold), said at the probe where it first does.
"""

from __future__ import annotations

import math

import pandas as pd

from .. import vocab


def _values(frame: pd.DataFrame, kind: str, metric: str) -> pd.Series:
    """The metric's values of one site kind, indexed by (layer, head)."""
    rows = frame[(frame["site_kind"] == kind) & (frame["metric"] == metric)]
    return rows.set_index(["layer", "head"])["value"].astype(float)


def live_scalars(frame: pd.DataFrame, top_k: int = vocab.MONITOR_TOP_HEADS) -> dict[str, float]:
    """The logger's scalars of one probe (see the module docstring), in a stable order."""
    out: dict[str, float] = {}
    loss = _values(frame, vocab.LM_HEAD, vocab.LOSS)
    if len(loss):
        out["peakprobe/loss"] = float(loss.iloc[0])
    for metric in (vocab.LOGIT_STD, vocab.ENTROPY, vocab.LOGIT_MAX):
        lm = _values(frame, vocab.LM_HEAD, metric)
        if len(lm):
            out[f"peakprobe/lm_head/{metric}"] = float(lm.iloc[0])
    std = _values(frame, vocab.ATTN, vocab.LOGIT_STD)
    entropy = _values(frame, vocab.ATTN, vocab.ENTROPY)
    for layer in sorted({int(i[0]) for i in std.index}):
        out[f"peakprobe/L{layer}/logit_std_median"] = float(std.xs(layer, level="layer").median())
        if len(entropy):
            out[f"peakprobe/L{layer}/entropy_median"] = float(entropy.xs(layer, level="layer").median())
    top = _values(frame, vocab.ATTN, vocab.LOGIT_MAX)
    if len(top):
        out["peakprobe/logit_max"] = float(top.max())
    by_std = _values(frame, vocab.ATTN, vocab.PEAKED)
    peaked = _values(frame, vocab.ATTN, vocab.PEAKED_ENTROPY)
    if len(peaked) and len(by_std):
        out["peakprobe/n_peaked_heads_logit_std"] = float((by_std >= vocab.PEAKED_FRACTION).sum())
    peaked = peaked if len(peaked) else by_std  # the headline rule, else the flag there is
    if len(peaked):
        out["peakprobe/n_peaked_heads"] = float((peaked >= vocab.PEAKED_FRACTION).sum())
    if len(std) and top_k > 0:
        is_peaked = (peaked.reindex(std.index) >= vocab.PEAKED_FRACTION) if len(peaked) else False
        ranked = pd.DataFrame({"std": std, "peaked": is_peaked}).sort_values(
            ["peaked", "std"], ascending=[False, False], kind="stable"
        )
        for (layer, head), row in ranked.head(top_k).iterrows():
            out[f"peakprobe/top/L{int(layer)}H{int(head)}/logit_std"] = float(row["std"])
    return out


def alarms(previous: pd.DataFrame | None, frame: pd.DataFrame, *, jumps: bool = True,
           logit_max_limit: float | None = vocab.LOGIT_MAX_ALARM) -> list[str]:
    """One-line warnings for this probe against the previous one (None at the first probe).

    ``jumps=False`` checks only for collapse and the max logit: the monitor compares logit stds
    only between probes after the warmup, since growth away from the initialisation is no
    anomaly. ``logit_max_limit`` None: no max-logit alarm."""
    step = int(frame["step"].iloc[0]) if "step" in frame and len(frame) else -1
    found: list[str] = []
    if logit_max_limit is not None:
        now_max = _values(frame, vocab.ATTN, vocab.LOGIT_MAX)
        was_max = _values(previous, vocab.ATTN, vocab.LOGIT_MAX) if previous is not None else None
        for (layer, head), value in now_max.items():
            was = None if was_max is None else was_max.get((layer, head))
            if value > logit_max_limit and (was is None or not was > logit_max_limit):
                found.append(
                    f"max logit at step {step}: {vocab.site_label(vocab.ATTN, layer, head)} logit_max "
                    f"{value:.4g} > {logit_max_limit:g} (the threshold QK-clip / MuonClip act on)"
                )
    now = _values(frame, vocab.ATTN, vocab.ENTROPY_NORM)
    before = _values(previous, vocab.ATTN, vocab.ENTROPY_NORM) if previous is not None else None
    for (layer, head), value in now.items():
        was = None if before is None else before.get((layer, head))
        if value < vocab.ENTROPY_COLLAPSE and (was is None or not was < vocab.ENTROPY_COLLAPSE):
            found.append(
                f"attention-entropy collapse at step {step}: {vocab.site_label(vocab.ATTN, layer, head)} "
                f"entropy_norm {value:.4g} < ENTROPY_COLLAPSE {vocab.ENTROPY_COLLAPSE:g}"
            )
    if previous is None or not jumps:
        return found
    prev_step = int(previous["step"].iloc[0]) if "step" in previous and len(previous) else -1
    for kind in (vocab.ATTN, vocab.LM_HEAD):
        now_std, was_std = _values(frame, kind, vocab.LOGIT_STD), _values(previous, kind, vocab.LOGIT_STD)
        for (layer, head), value in now_std.items():
            was = was_std.get((layer, head))
            if was is None or not (was > 0 and math.isfinite(value)):
                continue
            if value > vocab.LOGIT_STD_JUMP * was:
                found.append(
                    f"logit-std jump at step {step}: {vocab.site_label(kind, layer, head)} logit_std "
                    f"{was:.4g} -> {value:.4g} (x{value / was:.3g} since step {prev_step}, "
                    f"> LOGIT_STD_JUMP {vocab.LOGIT_STD_JUMP:g})"
                )
    return found
