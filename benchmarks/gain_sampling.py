"""How many attribution windows resolve a gain: the optimal-temperature gain of the LM head and
of all attention heads together, from the first N evaluation windows (what the attribution
reports with ``--attribution-windows N``) and from random N-window subsets, against all windows.

A gain measured on a sample is an in-sample minimum, G = L(0) - min over beta of L(beta), so
sampling noise both spreads it and biases it upward: where the population's gain is small the
sample's gain is mostly noise. This prints, per site and N, the gain of the first N windows,
and the mean and standard deviation over random N-window subsets, beside the gain of all
windows. The loss of every window is computed once per point of a grid on log beta (the gain
is read off the grid: step 0.01 within 0.3 of log beta = 0, 0.1 out to 1.5, so it can fall short
of the search's by about the curvature times the squared half-step), so subsets cost nothing
extra.

Needs a trained checkpoint; the demo's are used by default (run ``peakprobe demo`` first):

    python benchmarks/gain_sampling.py [--model peakprobe-demo/tiny-pythia/step800]
        [--windows 64] [--window 256] [--sizes 3 4 8 16 32] [--draws 300]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM

from peakprobe import corpus
from peakprobe.attribution.tempered import tempered
from peakprobe.data import load_eval_data

# log beta: step 0.01 within 0.3 of beta = 1 (small gains have their minimum there), 0.1 beyond
GRID = np.unique(np.round(np.concatenate([np.linspace(-0.3, 0.3, 61), np.linspace(-1.5, 1.5, 31)]), 6))


def _ce(z: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor, scale: float = 1.0) -> np.ndarray:
    """Summed next-token cross-entropy per window of logits scale * z (b, T, V), in float64."""
    z = z[:, :-1].to(torch.float64) * scale  # (b, T-1, V)
    ok = (mask[:, 1:] * mask[:, :-1]).bool()  # (b, T-1)
    logp = torch.log_softmax(z, -1).gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    return ((-logp) * ok).sum(1).numpy()


def _logits(model, ids: torch.Tensor, mask: torch.Tensor, batch: int = 16) -> list[torch.Tensor]:
    return [model(input_ids=ids[i:i + batch], attention_mask=mask[i:i + batch], use_cache=False).logits
            for i in range(0, ids.shape[0], batch)]


@torch.no_grad()
def loss_grid(model, ids: torch.Tensor, mask: torch.Tensor, batch: int = 16) -> dict[str, np.ndarray]:
    """Per site, the summed loss of every window at every grid point: (len(GRID), windows)."""
    parts = [(ids[i:i + batch], mask[i:i + batch]) for i in range(0, ids.shape[0], batch)]

    def losses(logits: list[torch.Tensor], scale: float = 1.0) -> np.ndarray:
        return np.concatenate([_ce(z, i, m, scale) for z, (i, m) in zip(logits, parts, strict=True)])

    base = _logits(model, ids, mask, batch)  # the LM head's beta scales these: no re-forward
    lm = np.stack([losses(base, float(np.exp(x))) for x in GRID])
    layers, heads = model.config.num_hidden_layers, model.config.num_attention_heads
    attn = []
    with tempered(model) as state:
        for x in GRID:
            state.betas = {i: torch.full((heads,), float(np.exp(x))) for i in range(layers)}
            attn.append(losses(_logits(model, ids, mask, batch)))
    return {"lm_head": lm, "attn_all": np.stack(attn)}


def gain(sums: np.ndarray, counts: np.ndarray, idx: np.ndarray) -> float:
    """G of the windows ``idx``: the mean loss at log beta 0 minus its minimum on the grid."""
    curve = sums[:, idx].sum(1) / counts[idx].sum()  # (grid,)
    return float(curve[int(np.argmin(np.abs(GRID)))] - curve.min())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="peakprobe-demo/tiny-pythia/step800")
    parser.add_argument("--windows", type=int, default=64)
    parser.add_argument("--window", type=int, default=256)
    parser.add_argument("--sizes", type=int, nargs="+", default=[3, 4, 8, 16, 32])
    parser.add_argument("--draws", type=int, default=300)
    args = parser.parse_args(argv)
    if not (Path(args.model) / "config.json").is_file():
        print(f"error: no checkpoint at {args.model} (run `peakprobe demo` first, or pass --model)",
              file=sys.stderr)
        return 2
    model = AutoModelForCausalLM.from_pretrained(args.model).eval()
    tokenizer = corpus.build_tokenizer(model_max_length=max(2048, args.window))
    data = load_eval_data("embedded", tokenizer, n_windows=args.windows, window=args.window)
    ids, mask = data.input_ids, data.attention_mask
    n = ids.shape[0]
    counts = (mask[:, 1:] * mask[:, :-1]).sum(1).numpy()
    sizes = [s for s in args.sizes if 0 < s < n]
    rng = np.random.default_rng(0)
    draws = {s: [rng.choice(n, s, replace=False) for _ in range(args.draws)] for s in sizes}
    grids = loss_grid(model, ids, mask)
    loss0 = grids["lm_head"][int(np.argmin(np.abs(GRID)))].sum() / counts.sum()
    print(f"{args.model}: {n} embedded windows x {args.window} tokens, L = {loss0:.4f}; gains on "
          f"a grid of {len(GRID)} log beta in [{GRID[0]:g}, {GRID[-1]:g}]; random subsets: {args.draws} draws")
    print(f"{'site':<10}{'N':>4}{'first N':>11}{'random mean':>13}{'random sd':>11}{'all':>11}")
    for site, sums in grids.items():
        whole = gain(sums, counts, np.arange(n))
        for s in sizes:
            sample = np.array([gain(sums, counts, idx) for idx in draws[s]])
            first = gain(sums, counts, np.arange(s))
            print(f"{site:<10}{s:>4}{first:>11.5f}{sample.mean():>13.5f}{sample.std():>11.5f}{whole:>11.5f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
