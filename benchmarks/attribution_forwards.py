"""Model forwards one checkpoint's attribution makes, counted on CPU.

On a GPU a forward's cost is mostly its launches, so the attribution's cost there is its number
of forwards. This counts them (a forward pre-hook on the model) for one ``attribute`` call on
the evaluation windows of a checkpoint, both ways the searches can run:

* ``lockstep`` (the GPU's path): every site's search advances together; each round's
  evaluations run as batched forwards, one per group of settings that change the same layers
  (a layer's heads with that layer's group search; all attention apart);
* one by one (the CPU's path): one forward per evaluation and batch.

Both include the slopes' forward and backward (one forward per batch). Model: a random-init
GPT-NeoX (``--layers``, 256 wide, 8 heads, vocab 1024), float32; ``--trained-steps`` first
trains it on repeated random sequences so that heads sharpen and their searches run longer.

    python benchmarks/attribution_forwards.py [--layers 6] [--windows 4] [--length 256]

prints ``attribution_forwards=`` (the lockstep path) and the one-by-one count beside it.
"""

from __future__ import annotations

import argparse

import torch
from transformers import AutoModelForCausalLM, GPTNeoXConfig

from peakprobe.attribution import attribute


def _model(layers: int, steps: int, length: int) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = GPTNeoXConfig(vocab_size=1024, hidden_size=256, num_hidden_layers=layers, num_attention_heads=8,
                        intermediate_size=1024, max_position_embeddings=2048, attn_implementation="sdpa")
    model = AutoModelForCausalLM.from_config(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(steps):  # repeated halves: the second half is predictable from the first
        half = torch.randint(0, 1024, (8, length // 2))
        ids = torch.cat([half, half], dim=1)
        loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


def _count(model: torch.nn.Module, batches, lockstep: bool) -> int:
    calls = [0]
    handle = model.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    try:
        attribute(model, batches, lockstep=lockstep)
    finally:
        handle.remove()
    return calls[0]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--windows", type=int, default=4, help="attribution windows (the default's 4)")
    ap.add_argument("--length", type=int, default=256, help="tokens per window")
    ap.add_argument("--trained-steps", type=int, default=60)
    args = ap.parse_args(argv)
    model = _model(args.layers, args.trained_steps, args.length)
    g = torch.Generator().manual_seed(1)
    half = torch.randint(0, 1024, (args.windows, args.length // 2), generator=g)
    ids = torch.cat([half, half], dim=1)  # (N, T)
    batches = [(ids[i : i + 1], None) for i in range(args.windows)]
    together = _count(model, batches, lockstep=True)
    one_by_one = _count(model, batches, lockstep=False)
    print(f"model: GPT-NeoX {args.layers} layers x 8 heads, {args.windows} windows x {args.length} tokens, "
          f"{args.trained_steps} training steps")
    print(f"attribution_forwards={together} one_by_one_forwards={one_by_one} "
          f"ratio={together / one_by_one:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
