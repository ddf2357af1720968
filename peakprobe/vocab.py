"""The one vocabulary of peakprobe: site kinds and labels, metric names, thresholds, verdict words.

Every stage (probes, hooks, sweep, fits, reports, integrations) takes its names and constants
from here, so a metric, a site label or a threshold is defined exactly once. This module
imports nothing heavy (no torch, no pandas) and sits above every other module of the package.
"""

from __future__ import annotations

# -- site kinds --------------------------------------------------------------------------------
#: one attention head (layer, head)
ATTN = "attn"
#: one inverse temperature shared by the heads of one layer (layer, head = -1); attribution only
ATTN_LAYER = "attn_layer"
#: one inverse temperature shared by every attention head (layer = head = -1); attribution only
ATTN_ALL = "attn_all"
#: the next-token softmax over the vocabulary (layer = head = -1)
LM_HEAD = "lm_head"
#: a mixture-of-experts layer's softmax over its experts, one row per token (layer, head = -1)
ROUTER = "router"
#: the site kinds the peaked / concentrating / saturated classes are given to
CLASSIFIED_KINDS: tuple[str, ...] = (ATTN, LM_HEAD, ROUTER)


def site_label(kind: str, layer: int = -1, head: int = -1) -> str:
    """Human label of a site: ``attn L3 H5``, ``attn L3 (all heads)``, ``attention (all heads)``,
    ``LM head``, ``router L2``."""
    if kind == ATTN:
        return f"attn L{int(layer)} H{int(head)}"
    if kind == ATTN_LAYER:
        return f"attn L{int(layer)} (all heads)"
    if kind == ATTN_ALL:
        return "attention (all heads)"
    if kind == LM_HEAD:
        return "LM head"
    if kind == ROUTER:
        return f"router L{int(layer)}"
    raise ValueError(f"unknown site kind {kind!r}")


# -- metrics measured per row and averaged over rows (the probes; docs/probes.md) -------------------
#: -sum p log p, nats
ENTROPY = "entropy"
#: entropy / ln n (1 = uniform, 0 = one-hot)
ENTROPY_NORM = "entropy_norm"
#: the largest probability
MAX_PROB = "max_prob"
#: population std of the logits over the row's options: the papers' "logit magnitude"
LOGIT_STD = "logit_std"
#: the largest logit minus the mean logit
LOGIT_MAX_MINUS_MEAN = "logit_max_minus_mean"
#: the largest logit minus the second largest
LOGIT_TOP_GAP = "logit_top_gap"
#: 1 when logit_std > sqrt(2 ln n) (the random-energy model's low-temperature phase), else 0
PEAKED = "peaked"
#: attention: the probability on the row's first visible key (the attention-sink mass)
FIRST_KEY_PROB = "first_key_prob"
#: LM head: next-token cross-entropy, the probability of the target, its logit minus the mean
LOSS = "loss"
TARGET_PROB = "target_prob"
TARGET_LOGIT_MINUS_MEAN = "target_logit_minus_mean"
#: every softmax site
COMMON_METRICS: tuple[str, ...] = (
    ENTROPY,
    ENTROPY_NORM,
    MAX_PROB,
    LOGIT_STD,
    LOGIT_MAX_MINUS_MEAN,
    LOGIT_TOP_GAP,
    PEAKED,
)
#: the LM head adds the next-token statistics
LM_EXTRA: tuple[str, ...] = (LOSS, TARGET_PROB, TARGET_LOGIT_MINUS_MEAN)
#: peakedness as the authors judge it: the inverse temperature at which Gaussian logits over the
#: row's n options have the row's entropy, and the flag beta_eff > sqrt(2 ln n)
BETA_EFF = "beta_eff"
PEAKED_ENTROPY = "peaked_entropy"
#: attention statistics with the first visible key (the sink) left out, suffix "_xsink"
XSINK_SUFFIX = "_xsink"
#: models with a learned sink logit per head (gpt-oss): the probability the sink takes
SINK_PROB = "sink_prob"
#: every site also reports peakedness by entropy (rows with n >= 2 options)
ENTROPY_PEAKED_METRICS: tuple[str, ...] = (BETA_EFF, PEAKED_ENTROPY)
#: attention sites also report these with the first visible key left out (rows with >= 2 others)
XSINK_METRICS: tuple[str, ...] = tuple(
    name + XSINK_SUFFIX for name in (ENTROPY, MAX_PROB, LOGIT_STD, PEAKED, BETA_EFF, PEAKED_ENTROPY)
)
#: the row's largest logit (over its real options, not a learned sink), averaged over rows
LOGIT_ROW_MAX = "logit_row_max"
#: everything the probes write per site as a row mean (attention sites add the probability on
#: the first visible key; those of models with learned sinks add SINK_PROB)
ATTN_PROBE_METRICS: tuple[str, ...] = (
    COMMON_METRICS + (FIRST_KEY_PROB,) + ENTROPY_PEAKED_METRICS + XSINK_METRICS + (LOGIT_ROW_MAX,)
)
LM_PROBE_METRICS: tuple[str, ...] = (
    COMMON_METRICS + LM_EXTRA + ENTROPY_PEAKED_METRICS + (LOGIT_ROW_MAX,)
)

# -- head roles, on a fixed diagnostic batch of repeated random tokens [x_1..x_n, x_1..x_n] ------
#: attention on the key after the earlier copy of the query's token (rows of the second copy)
INDUCTION_SCORE = "induction_score"
#: attention on the previous position (every row but the first)
PREV_TOKEN_SCORE = "prev_token_score"
#: attention on the earlier copy of the query's token (rows of the second copy)
DUPLICATE_SCORE = "duplicate_score"
ROLE_METRICS: tuple[str, ...] = (INDUCTION_SCORE, PREV_TOKEN_SCORE, DUPLICATE_SCORE)
#: a head's role: the role whose score is largest at that checkpoint, when it is at least
#: ROLE_THRESHOLD; the sink role reads FIRST_KEY_PROB (the evaluation windows' sink mass)
ROLE_OF: dict[str, str] = {"induction": INDUCTION_SCORE, "previous-token": PREV_TOKEN_SCORE,
                           "duplicate-token": DUPLICATE_SCORE, "sink": FIRST_KEY_PROB}
ROLE_THRESHOLD = 0.4
#: the diagnostic batch: sequences, the period n (halved to fit the model's positions), its seed
ROLE_SEQUENCES = 8
ROLE_PERIOD = 32
ROLE_SEED = 1234

# -- why the logits grow: the query-key geometry of each head over its visible pairs ------------
#: mean query norm over rows, mean key norm and mean cosine of q and k over visible pairs (the
#: q and k the softmax sees: after any q/k norm and rotary)
Q_NORM = "q_norm"
K_NORM = "k_norm"
QK_COS = "qk_cos"
#: the exact decomposition logit_rms = scaling * q_rms * k_rms * qk_align over visible pairs:
#: the RMS logit (scaling * q.k, before softcapping and biases), the RMS query and key norms
#: (pair-weighted), and the alignment factor RMS(q.k) / (q_rms * k_rms)
LOGIT_RMS = "logit_rms"
Q_RMS = "q_rms"
K_RMS = "k_rms"
QK_ALIGN = "qk_align"
#: a weight figure per head and checkpoint: scaling * ||W_Q,h^T W_K,h||_2, the largest singular
#: value of the head's bilinear form x_i^T W_Q^T W_K x_j (projection weights as stored, no
#: biases, norms or rotary; grouped-query heads use their group's key weight), times the same
#: scaling as LOGIT_RMS: what sigma-reparam bounds (docs/probes.md for the caveats)
QK_SPECTRAL = "qk_spectral_norm"
#: the query-key geometry: the pair statistics above and the weight figure
GEOMETRY_METRICS: tuple[str, ...] = (Q_NORM, K_NORM, QK_COS, LOGIT_RMS, Q_RMS, K_RMS, QK_ALIGN, QK_SPECTRAL)
#: the factors of LOGIT_RMS whose growth exponents add up to its own
LOGIT_FACTORS: tuple[str, ...] = (Q_RMS, K_RMS, QK_ALIGN)
#: LM head: mean norm of the final hidden state the LM head reads, mean norm of the unembedding
#: rows (over the vocabulary; a per-checkpoint weight figure), mean log Z = logsumexp of the
#: logits (the quantity z-loss penalises)
HIDDEN_NORM = "hidden_norm"
UNEMBED_NORM = "unembed_norm"
LOG_Z = "log_z"
LM_FACTOR_METRICS: tuple[str, ...] = (HIDDEN_NORM, UNEMBED_NORM, LOG_Z)

# -- MoE routers (one row per token, over the layer's experts) ------------------------------------
#: router: the probability mass of the k experts the token is sent to (k = the model's top-k)
TOPK_MASS = "topk_mass"
#: router row means: the common statistics, peakedness by entropy, the top-k mass
ROUTER_PROBE_METRICS: tuple[str, ...] = (
    COMMON_METRICS + ENTROPY_PEAKED_METRICS + (LOGIT_ROW_MAX, TOPK_MASS)
)
#: router load balance over the tokens (not row means): the entropy (nats) of the share of
#: top-k assignments each expert receives, the fraction of experts no token selects, and the
#: largest expert's load over the mean load (1 = perfectly balanced)
LOAD_ENTROPY = "load_entropy"
DEAD_EXPERTS = "dead_experts"
LOAD_MAX_OVER_MEAN = "load_max_over_mean"
LOAD_METRICS: tuple[str, ...] = (LOAD_ENTROPY, DEAD_EXPERTS, LOAD_MAX_OVER_MEAN)

# -- per-site figures that are not row means ---------------------------------------------------
#: the largest logit over a site's rows and options (the quantity QK-clip and MuonClip control):
#: merged by max, not averaged; its ``n_rows`` counts the rows it was taken over
LOGIT_MAX = "logit_max"
#: row statistics whose quantiles over rows each site reports, from a fixed-bin histogram that
#: merges exactly across batches (no per-row storage)
QUANTILE_OF: tuple[str, ...] = (ENTROPY, MAX_PROB)
QUANTILES: tuple[float, ...] = (0.1, 0.5, 0.9)
#: histogram bins per statistic and their range (values outside are clamped into the end bins;
#: entropy in nats: ln n is below 16 for any n under 8.8 million options)
HIST_BINS = 512
HIST_RANGE: dict[str, tuple[float, float]] = {ENTROPY: (0.0, 16.0), MAX_PROB: (0.0, 1.0)}


def quantile_metric(name: str, q: float) -> str:
    """The metric name of quantile ``q`` of row statistic ``name``: ``entropy_q10``."""
    return f"{name}_q{round(100 * q):02d}"


QUANTILE_METRICS: tuple[str, ...] = tuple(quantile_metric(n, q) for n in QUANTILE_OF for q in QUANTILES)
#: what every probed site reports beyond its row means
SITE_METRICS: tuple[str, ...] = (LOGIT_MAX,) + QUANTILE_METRICS

# -- attribution metrics (per site, from an inverse temperature beta on that site's logits) ----------
#: d loss / d log beta at beta = 1
SENSITIVITY = "sensitivity"
#: d^2 loss / d (log beta)^2 at beta = 1
CURVATURE = "curvature"
#: the optimal-temperature gain G = L(beta = 1) - min_beta L(beta)
GAIN = "gain"
#: log of the minimising beta
LOG_BETA_OPT = "log_beta_opt"
ATTRIBUTION_METRICS: tuple[str, ...] = (SENSITIVITY, CURVATURE, GAIN, LOG_BETA_OPT)
#: the LM head's mean next-token loss over the attribution windows at beta = 1: the tokens every
#: gain is measured on, so a gain's share of the loss decrease reads its loss law (one row, LM head)
ATTRIBUTION_LOSS = "attribution_loss"
#: the LM head's gain with every attention head at attention's best beta (the all-heads search's
#: optimum): the part of its gain that is its own, not a soft attention's showing downstream; the
#: LM head's share of the loss decrease is read from it (one row, LM head)
GAIN_AFTER_ATTENTION = "gain_after_attention"
#: every metric the attribution writes
ATTRIBUTION_ROW_METRICS: tuple[str, ...] = (*ATTRIBUTION_METRICS, ATTRIBUTION_LOSS, GAIN_AFTER_ATTENTION)

#: the metrics the growth laws are fitted to: logit magnitudes (the 1/3 law is about these)
#: and, as descriptive effective exponents, max_prob and entropy
GROWTH_METRICS: tuple[str, ...] = (
    LOGIT_STD,
    LOGIT_MAX_MINUS_MEAN,
    LOGIT_TOP_GAP,
    TARGET_LOGIT_MINUS_MEAN,
    MAX_PROB,
    ENTROPY,
    LOGIT_MAX,
    LOGIT_ROW_MAX,
    TOPK_MASS,
    LOAD_ENTROPY,
    LOAD_MAX_OVER_MEAN,
    LOGIT_RMS,
    Q_RMS,
    K_RMS,
    QK_ALIGN,
    Q_NORM,
    K_NORM,
    QK_SPECTRAL,
    HIDDEN_NORM,
    UNEMBED_NORM,
    LOG_Z,
)
#: the per-site metrics the report's table shows at the last checkpoint
FINAL_METRICS: tuple[str, ...] = (
    LOGIT_STD,
    ENTROPY,
    MAX_PROB,
    PEAKED,
    FIRST_KEY_PROB,
    LOGIT_MAX,
)

# -- kinds of fit (fits.parquet's ``fit`` column) -------------------------------------------------
#: a site metric's power law m = c t^alpha
FIT_GROWTH = "growth"
#: the loss law L = L0 + c t^-alpha of the LM head's loss
FIT_LOSS = "loss"
#: a site's optimal-temperature gain G = c t^-alpha
FIT_GAIN = "gain"

# -- thresholds --------------------------------------------------------------------------------
THIRD = 1.0 / 3.0
#: the default equivalence band around 1/3 for the three-way verdict
BAND: tuple[float, float] = (0.25, 0.42)
#: the confidence level of every interval
CI_LEVEL = 0.9
#: a site is peaked when at least this share of its rows is (at the window's last checkpoint)
PEAKED_FRACTION = 0.5
#: a late logit_std exponent whose lower bound exceeds this is still growing
GROWTH_FLOOR = 0.05


# -- evaluation windows (data.py) --------------------------------------------------------------------
#: one document per window, right-padded (as the 1/3 authors measure Pythia)
DOCUMENT = "document"
#: documents packed back to back into full windows, each attending across the boundaries
PACKED = "packed"
#: packed windows in which each document attends to itself only (position ids restart)
PACKED_DOCS = "packed-docs"
LAYOUTS: tuple[str, ...] = (DOCUMENT, PACKED, PACKED_DOCS)

# -- run-directory files written beside the results (see results.py) ---------------------------------
#: checkpoints whose weights duplicate another's, written by the sweep; fits exclude them
INTEGRITY = "integrity.json"
#: what a toy run (``peakprobe toy peaked|linear``) writes beside its figures: exponents, windows
TOY_FILE = "toy.json"

# -- verdict words -------------------------------------------------------------------------------
#: the three-way judgement of an exponent against 1/3 (see fits)
CONSISTENT = "consistent"
INCONSISTENT = "inconsistent"
INCONCLUSIVE = "inconclusive"
THIRD_VERDICTS: tuple[str, ...] = (CONSISTENT, INCONSISTENT, INCONCLUSIVE)
#: the bottleneck answer: the softmax kind that holds the loss back, none, or not decidable
BOTTLENECK_ATTENTION = "attention"
BOTTLENECK_LM_HEAD = "lm_head"
BOTTLENECK_NONE = "none"
BOTTLENECK_UNDETERMINED = "undetermined"

class PeakprobeError(ValueError):
    """Base class of every error a user can cause: bad input, an option out of range, a model or
    a run directory peakprobe cannot use, too few checkpoints to fit. The command line prints it
    as one line and exits 2; any other exception is a bug in peakprobe (exit 1). A ValueError,
    so callers that catch ValueError keep working."""


class PeakprobeWarning(UserWarning):
    """Base class of every warning peakprobe issues; the command line shows these by default
    (one line each, ``peakprobe: warning: ...``) and hides other libraries' warnings."""

# -- the bottleneck answer from gains (fits) ------------------------------------------------------
#: the logit magnitudes whose growth exponents are judged against 1/3 (the rest are descriptive)
MAGNITUDE_METRICS: tuple[str, ...] = (
    LOGIT_STD,
    LOGIT_MAX_MINUS_MEAN,
    LOGIT_TOP_GAP,
    TARGET_LOGIT_MINUS_MEAN,
)
#: a site's gain explains a "large share" of the loss decrease over the fit window above this fraction
GAIN_SHARE_MIN = 0.1
#: a single head's gain below this fraction of the loss is negligible: it would reach the share
#: threshold (GAIN_SHARE_MIN of L - L0) only when L - L0 is under 1% of L; screened heads whose
#: screen promises less are not searched
HEAD_GAIN_FLOOR = 1e-3
#: the false-discovery rate of the Benjamini-Hochberg control over sites
FDR = 0.1
#: a share interval reaching above this fraction of L - L0 says nothing about the site (the
#: whole reducible loss is 1): such sites rank after the informative ones among the top sites
SHARE_CI_INFORMATIVE = 1.0

# -- live probing during training (integrations/) ---------------------------------------------------
#: probes over the planned training, log-spaced, by default (step 0 and the last step included)
MONITOR_POINTS = 40
#: of those, about this many log-spaced probes (the last one included) also run the attribution
#: (gains, curvature, sensitivity): it costs several forwards a probe, the statistics one
MONITOR_ATTRIBUTION_POINTS = 8
#: evaluation windows the live attribution runs on when no config is given (sweeps: 4)
MONITOR_ATTRIBUTION_WINDOWS = 2
#: attention heads named in the live summary scalars (largest logit_std first)
MONITOR_TOP_HEADS = 3
#: alarm, attention-entropy collapse: a head's entropy_norm (entropy / ln n, 1 = uniform,
#: 0 = one-hot) falls below this
ENTROPY_COLLAPSE = 0.05
#: alarm, max logit: a head's largest attention logit (``LOGIT_MAX``) exceeds this; Kimi K2's
#: MuonClip clips the query-key products of heads past 100 (QK-clip's threshold tau)
LOGIT_MAX_ALARM = 100.0
#: alarm, jump in logit std: a site's logit_std grows by more than this factor between two
#: consecutive probes (the 1/3 law needs dynamic time to grow 8x for a factor 2)
LOGIT_STD_JUMP = 2.0
#: the live run's own file beside the results: per-update learning rates, lr_max, planned steps
MONITOR_FILE = "monitor.json"
