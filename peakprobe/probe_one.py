"""One checkpoint, probed and printed: the ``peakprobe probe MODEL_DIR`` table."""

from __future__ import annotations

import os
from pathlib import Path

import pandas as pd

from peakprobe import vocab

from .config import DataConfig
from .data import DataError
from .vocab import site_label

#: the table's columns: peakedness by the entropy-equivalent rule first (the one the bottleneck
#: verdict uses), the logit-std rule after the logit std it reads
COLUMNS = [vocab.PEAKED_ENTROPY, vocab.BETA_EFF, vocab.MAX_PROB, vocab.ENTROPY_NORM, vocab.LOGIT_STD,
           vocab.PEAKED, vocab.LOGIT_TOP_GAP, vocab.FIRST_KEY_PROB, vocab.LOGIT_MAX]


#: evaluation windows of ``peakprobe probe`` (one checkpoint; sweeps use DataConfig's default)
PROBE_WINDOWS = 8


def probe_folder(
    model_dir: str | os.PathLike,
    data: DataConfig | None = None,
    *,
    allow_pickle: bool = False,
    attribution: bool = False,
) -> pd.DataFrame:
    """Tidy per-site statistics of the checkpoint in ``model_dir`` over the windows ``data``
    describes (default: the embedded corpus, ``PROBE_WINDOWS`` windows); ``attribution`` also
    runs the loss attribution (``AttributionConfig``).

    A folder without a config or a loadable tokenizer is a one-line ``DataError``, never a
    traceback. ``data.window=None`` is the default window fitted to the model's maximum
    positions (``data.window_for``)."""
    from .checkpoint import load_config, load_model, load_tokenizer, probe_model
    from .config import AttributionConfig, SweepConfig
    from .data import load_eval_data, window_for

    data = data or DataConfig(n_windows=PROBE_WINDOWS)
    folder = Path(model_dir)
    if not (folder / "config.json").is_file():
        raise DataError(f"{folder} is not a saved model folder (no config.json)")
    config = SweepConfig(allow_pickle=allow_pickle, prefetch=False,
                         attribution=AttributionConfig(enabled=attribution))
    tok = load_tokenizer(folder, data.tokenizer)
    window = window_for(load_config(str(folder), None, config), data.window)
    windows = load_eval_data(data.data, tok, n_windows=data.n_windows, window=window,
                             text_field=data.text_field, layout=data.layout)
    model = load_model(str(folder), None, config, "cuda" if _cuda() else "cpu")
    return probe_model(model, windows, config)


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def format_probe_table(frame: pd.DataFrame, sort_by: str = vocab.BETA_EFF) -> str:
    """One line per head (and the LM head), sorted by ``sort_by`` descending."""
    wide = frame.pivot_table(index=["site_kind", "layer", "head"], columns="metric", values="value")
    if sort_by not in wide.columns:
        raise DataError(f"unknown metric {sort_by!r}; choose from {', '.join(sorted(wide.columns))}")
    wide = wide.sort_values(sort_by, ascending=False)
    cols = [c for c in COLUMNS if c in wide.columns]
    lines = [f"{'site':<14}" + "".join(f"{c:>16}" for c in cols)]
    for (kind, layer, head), row in wide.iterrows():
        name = site_label(kind, layer, head)
        cells = "".join(f"{'':>16}" if pd.isna(row.get(c)) else f"{row[c]:>16.4f}" for c in cols)
        lines.append(f"{name:<14}{cells}")
    lines.append(f"{vocab.PEAKED_ENTROPY} = share of rows whose entropy-equivalent {vocab.BETA_EFF} "
                 "exceeds sqrt(2 ln n), n = options in the row (the rule of the bottleneck verdict)")
    lines.append(f"{vocab.PEAKED} = share of rows whose {vocab.LOGIT_STD} exceeds sqrt(2 ln n) "
                 "(secondary: it misses near-deterministic rows)")
    return "\n".join(lines)
