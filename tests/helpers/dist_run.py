"""Test helper, and a torchrun script: tiny GPT-NeoX and Llama (GQA) models probed by a Monitor
under DDP, FSDP2 or tensor parallel on CPU (gloo).

    python -m torch.distributed.run --nproc_per_node 2 tests/helpers/dist_run.py MODE ARCH OUT

MODE is ddp, fsdp, tp or tp-vocab (tensor parallel with a vocab-parallel LM head); ARCH neox or
llama. The Monitor probes step 0 (the initialised model) into OUT/run; rank 0 prints a line.
``python tests/helpers/dist_run.py single ARCH OUT`` writes the single-process reference. The test
module starts the same ``worker`` with ``torch.multiprocessing.spawn``.
"""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from peakprobe.config import SweepConfig
from peakprobe.data import EvalData, token_hash
from peakprobe.integrations import Monitor, live_config

VOCAB = 61
WINDOW = 16
N_WINDOWS = 6  # 3 batches of 2: ranks get 1 and 2 (FSDP2 pads the first)
BATCH = 2


def tiny(arch: str, seed: int = 0, dropout: float = 0.0) -> torch.nn.Module:
    """2 layers; GPT-NeoX 4 heads, or Llama 4 query heads over 2 key/value heads (GQA)."""
    torch.manual_seed(seed)
    if arch == "neox":
        from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

        cfg = GPTNeoXConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=4, max_position_embeddings=64, rotary_pct=0.25,
                            hidden_dropout=dropout, attention_dropout=dropout, bos_token_id=0, eos_token_id=0)
        model = GPTNeoXForCausalLM(cfg)
    elif arch == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                          attention_dropout=dropout, tie_word_embeddings=False, bos_token_id=0, eos_token_id=0, pad_token_id=0)
        model = LlamaForCausalLM(cfg)
    else:
        raise SystemExit(f"unknown arch {arch}")
    model.config._attn_implementation = "eager"
    return model


def eval_data() -> EvalData:
    g = torch.Generator().manual_seed(2)
    half = torch.randint(1, VOCAB, (N_WINDOWS, WINDOW // 2), generator=g)
    ids = torch.cat([half, half], dim=1)  # (N, T): the second half repeats the first
    return EvalData(ids, torch.ones_like(ids), "repeat-windows", token_hash(ids))


def config(dtype: str = "float32") -> SweepConfig:
    live = live_config(attribution=False, dtype=dtype)  # statistics in the model's dtype
    return SweepConfig(batch_size=BATCH, probe=live.probe, attribution=live.attribution)


def layers(model):
    return model.gpt_neox.layers if hasattr(model, "gpt_neox") else model.model.layers


def tp_plan(model, vocab_parallel: bool) -> dict:
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan = {}
    for i, _ in enumerate(layers(model)):
        if hasattr(model, "gpt_neox"):
            pre = f"gpt_neox.layers.{i}.attention"
            plan[f"{pre}.query_key_value"] = ColwiseParallel()  # per head [q, k, v]: contiguous heads
            plan[f"{pre}.dense"] = RowwiseParallel()
        else:
            pre = f"model.layers.{i}.self_attn"
            for name in ("q_proj", "k_proj", "v_proj"):
                plan[f"{pre}.{name}"] = ColwiseParallel()
            plan[f"{pre}.o_proj"] = RowwiseParallel()
    if vocab_parallel:
        head = next(n for n, m in model.named_modules() if m is model.get_output_embeddings())
        plan[head] = ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)
    return plan


def wrap(model, mode: str):
    """The model as ``mode`` spreads it over the process group."""
    if mode == "ddp":
        return torch.nn.parallel.DistributedDataParallel(model)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    if mode == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for layer in layers(model):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model
    from torch.distributed.tensor.parallel import parallelize_module

    return parallelize_module(model, mesh, tp_plan(model, mode == "tp-vocab"))


def probe(mode: str, arch: str, out: Path, *, dtype: str = "float32", fail_rank: int | None = None,
          count: bool = False, fail_first: bool = False) -> dict:
    """Probe step 0 (and, with ``fail_rank``, step 2 with that rank's statistics raising; with
    ``fail_first`` too, step 0 already)."""
    model = tiny(arch).to(getattr(torch, dtype)).eval()
    model = wrap(model, mode) if mode != "single" else model
    monitor = Monitor(eval_data(), out / "run", total_steps=2, n_points=2, config=config(dtype), timeout=60)
    monitor.watch(model)
    counts = {"all_reduce": 0, "all_gather": 0, "all_gather_object": 0}
    real = {name: getattr(dist, name) for name in counts}
    if count:
        for name in counts:
            def counted(*a, _name=name, **k):
                counts[_name] += 1
                return real[_name](*a, **k)

            setattr(dist, name, counted)
    from peakprobe.hooks.engine import SiteStats

    attention = SiteStats.attention

    def broken(self, *a, **k):
        raise ValueError("planted failure in the statistics")

    try:
        if fail_first and dist.get_rank() == fail_rank:  # no earlier probe gave the layout
            SiteStats.attention = broken
        monitor.step(0)
        if fail_rank is not None:
            if dist.get_rank() == fail_rank:
                SiteStats.attention = broken
            monitor.step(2)
    finally:
        SiteStats.attention = attention
        for name, fn in real.items():
            setattr(dist, name, fn)
    return {"done": sorted(monitor.done), "failed": monitor.failed, "all_reduces": monitor.all_reduces,
            "counts": counts, "layout": monitor.layout.describe()}


def train(out: Path | None, *, steps: int = 12, seed: int = 0) -> list[float]:
    """FSDP2 training of the tiny GPT-NeoX (dropout 0.1) on per-rank batches; with a Monitor
    writing ``out``/run when ``out`` is given. The training losses, one per update."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = tiny("neox", seed, dropout=0.1)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in layers(model):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 3))
    monitor = None
    if out is not None:
        monitor = Monitor(eval_data(), out / "run", total_steps=steps, n_points=8, start=3,
                          config=config(), timeout=60)
        monitor.watch(model, optimizer, scheduler)
        monitor.step(0)
    g = torch.Generator().manual_seed(100 + dist.get_rank())  # each rank its own data
    torch.manual_seed(seed + dist.get_rank())
    losses = []
    model.train()
    for step in range(1, steps + 1):
        half = torch.randint(1, VOCAB, (4, WINDOW // 2), generator=g)
        batch = torch.cat([half, half], dim=1)
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        if monitor is not None:
            monitor.step(step)
    if monitor is not None:
        monitor.close()
    return losses


def callback(out: Path, steps: int = 6) -> dict:
    """The Trainer callback driven through the events the Trainer sends, on an FSDP2 model
    (accelerate's FSDP2 needs accelerators; on CPU it runs DDP): probes written on rank 0."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import TrainerControl, TrainerState, TrainingArguments

    from peakprobe.integrations import PeakprobeCallback

    model = tiny("llama", 0)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in layers(model):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    args = TrainingArguments(str(out / "trainer"), max_steps=steps, warmup_steps=2, use_cpu=True, report_to=[])
    state = TrainerState(max_steps=steps, is_world_process_zero=dist.get_rank() == 0)
    control = TrainerControl()
    cb = PeakprobeCallback(None, eval_data(), out / "run", n_points=4)  # live_config(): gains asked for
    cb.on_train_begin(args, state, control, model=model, optimizer=optimizer, lr_scheduler=None)
    g = torch.Generator().manual_seed(100 + dist.get_rank())
    model.train()
    for step in range(1, steps + 1):
        batch = torch.randint(1, VOCAB, (2, WINDOW), generator=g)
        model(input_ids=batch, labels=batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        state.global_step = step
        cb.on_step_end(args, state, control)
    cb.on_train_end(args, state, control)
    return {"done": sorted(cb.monitor.done), "planned": cb.monitor.planned, "layout": cb.monitor.layout.describe(),
            "failed": cb.monitor.failed, "attribution_steps": cb.monitor.attribution_steps}


def stalled(out: Path) -> dict:
    """Rank 1 never joins rank 0's probe (as a rank stuck elsewhere): rank 0's merge gives up
    after its 2 s timeout with a DistributedProbeError instead of hanging."""
    import time

    from peakprobe.integrations.distributed import DistributedProbeError

    monitor = Monitor(eval_data(), out / "run", total_steps=2, n_points=2, config=config(), timeout=2)
    monitor.watch(tiny("llama"))
    if dist.get_rank() == 1:
        time.sleep(10)
        return {"error": None}
    started = time.perf_counter()
    try:
        monitor.step(0)
    except DistributedProbeError as exc:
        return {"error": str(exc), "seconds": time.perf_counter() - started}
    return {"error": None}


def worker(rank: int, world: int, port: int, jobs: list[dict], out: str) -> None:
    """Run ``jobs`` in one gloo process group: each ``{"name": ..., "mode": ..., "arch": ...}``
    (``probe``'s keywords besides) writes OUT/name/rank<r>.json; ``{"name": ..., "train":
    true}`` trains without and with the Monitor and writes both loss lists."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=300))
    try:
        for job in jobs:
            job = dict(job)
            where = Path(out) / job.pop("name")
            if job.pop("train", False):
                got = {"without": train(None), "with": train(where)}
            elif job.pop("callback", False):
                got = callback(where)
            elif job.pop("stalled", False):
                got = stalled(where)
                where.mkdir(parents=True, exist_ok=True)
                (where / f"rank{rank}.json").write_text(json.dumps(got))
                os._exit(0)  # a collective is left pending: no orderly shutdown of the group
            else:
                got = probe(job.pop("mode"), job.pop("arch"), where, **job)
            where.mkdir(parents=True, exist_ok=True)
            (where / f"rank{rank}.json").write_text(json.dumps(got))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    torch.set_num_threads(1)
    mode, arch, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    if mode != "single":
        dist.init_process_group("gloo")
    got = probe(mode, arch, out)
    if mode == "single" or dist.get_rank() == 0:
        import pandas as pd

        frame = pd.read_parquet(out / "run" / "checkpoints" / "step0.parquet")
        attn = frame[frame.site_kind == "attn"]
        lm = frame[frame.site_kind == "lm_head"].set_index("metric")["value"]
        print(f"{mode} {arch}: layout {got['layout']}; probes at steps {got['done']}, "
              f"{got['all_reduces']} all-reduces per probe; heads {sorted(set(attn['head']))} in layers "
              f"{sorted(set(attn['layer']))}; LM head entropy {lm['entropy']:.6f}, logit_max {lm['logit_max']:.6f}",
              flush=True)
    if mode != "single":
        dist.destroy_process_group()
