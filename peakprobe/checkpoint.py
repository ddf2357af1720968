"""One checkpoint: load its config, tokenizer and model safely, check the model can take the
evaluation windows, and probe it over them.

``load_model`` loads safetensors weights unless pickle weights are allowed, and never runs remote
code unless asked; ``load_config`` reads the small config file before any weights;
``load_tokenizer`` is the one tokenizer loader. ``check_model`` refuses, before any forward pass,
a model that is not a causal language model and windows whose token ids fall outside the
model's embedding table (a tokenizer that does not fit). ``probe_model`` runs the probes over
every window and the attribution over the first few; ``tidy_frame`` adds the checkpoint's
columns. The loop over checkpoints is ``sweep``'s.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import pandas as pd
import torch
from tqdm.auto import tqdm

from .attribution import attribute
from .attribution.routers import router_gains
from .checkpoints_index import Checkpoint, CheckpointSequence
from .checkpoints_index.cache import hub_cache_dir
from .config import SweepConfig
from .data import DataError, EvalData
from .hf import quiet_transformers_progress
from .hooks import attach
from .hooks.sdpa import attach_sdpa
from .vocab import PeakprobeError, PeakprobeWarning

DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def _has_safetensors(folder: Path) -> bool:
    return any(folder.glob("*.safetensors"))


def load_model(source: str, revision: str | None, config: SweepConfig, device: str):
    """Load one checkpoint: a local folder (``revision`` ignored), or hub ``source`` at ``revision``."""
    from transformers import AutoModelForCausalLM

    kwargs: dict = {"trust_remote_code": config.trust_remote_code}
    kwargs["dtype"] = "auto" if config.dtype == "auto" else DTYPES[config.dtype]
    folder = Path(source).expanduser()
    if folder.is_dir():
        if not _has_safetensors(folder):
            if not config.allow_pickle:
                raise CheckpointError(
                    f"{folder} has no .safetensors weights; pickle weights can run code when "
                    "loaded: pass --allow-pickle only if you trust them"
                )
            kwargs["use_safetensors"] = False
        else:
            kwargs["use_safetensors"] = True
        source, revision = str(folder), None
    else:
        kwargs["use_safetensors"] = None if config.allow_pickle else True
        kwargs.update(cache_dir=str(hub_cache_dir()), local_files_only=config.local_files_only)
    if config.device_map is not None:
        kwargs["device_map"] = config.device_map
    try:
        with quiet_transformers_progress():
            model = AutoModelForCausalLM.from_pretrained(source, revision=revision, **kwargs)
    except OSError as exc:  # transformers' words for a hub revision with pickle weights only
        if kwargs.get("use_safetensors") and "cannot be loaded with `safetensors`" in str(exc):
            raise CheckpointError(
                f"{source}@{revision} has no .safetensors weights; pickle weights can run code when "
                "loaded: pass --allow-pickle only if you trust them"
            ) from None
        raise
    if config.device_map is None:
        model = model.to(device)
    return model.eval()


def load_config(source: str, revision: str | None, config: SweepConfig):
    """The model config of one checkpoint (a small file, read before any weights), from the same
    place ``load_model`` would load it; a one-line DataError when it cannot be read."""
    from transformers import AutoConfig

    kwargs: dict = {"trust_remote_code": config.trust_remote_code}
    folder = Path(source).expanduser()
    if folder.is_dir():
        source, revision = str(folder), None
    else:
        kwargs.update(cache_dir=str(hub_cache_dir()), local_files_only=config.local_files_only)
    try:
        return AutoConfig.from_pretrained(source, revision=revision, **kwargs)
    except Exception as exc:  # OSError, hub errors: one line
        at = f"{source}@{revision}" if revision else source
        raise DataError(f"cannot read the model config of {at} ({type(exc).__name__})") from exc


def load_tokenizer(
    where: str | os.PathLike | CheckpointSequence,
    tokenizer: str | None = None,
    *,
    local_files_only: bool = False,
):
    """The one tokenizer loader: ``tokenizer`` (a folder or hub id) when given; else the one
    saved with ``where`` (a folder), or, for a checkpoint sequence, with its first checkpoint
    (folder or hub revision), then with the repo's ``main``. Never requires ``main``.

    Raises :class:`DataError` (one line) when none loads."""
    from transformers import AutoTokenizer

    if tokenizer is not None:
        tries = [(str(tokenizer), None)]
    elif isinstance(where, CheckpointSequence):
        first = where[0]
        tries = [(first.path, None)] if first.path else [(where.source, first.revision), (where.source, "main")]
    else:
        tries = [(str(where), None)]
    hub = {} if Path(tries[0][0]).expanduser().is_dir() else {
        "cache_dir": str(hub_cache_dir()), "local_files_only": local_files_only}
    errors = []
    for source, revision in dict.fromkeys(tries):
        try:
            with quiet_transformers_progress():
                return AutoTokenizer.from_pretrained(source, revision=revision, **hub)
        except Exception as exc:  # OSError, ValueError, hub errors: try the next, then one line
            errors.append(f"{source}{'@' + revision if revision else ''} ({type(exc).__name__})")
    raise DataError(
        f"cannot load a tokenizer from {', '.join(errors)}; pass --tokenizer PATH to a local "
        "tokenizer folder"
    )


class AttributionWarning(PeakprobeWarning):
    """The attribution was asked for but cannot run on this model."""


class CheckpointError(PeakprobeError):
    """A checkpoint peakprobe must not or cannot probe: pickle weights not allowed, not a causal
    language model, a tokenizer that does not fit its embedding table."""


def _causal_lm_classes() -> set[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())


def check_causal_lm(model_config, where: str) -> None:
    """Refuse a config whose architecture is not a causal language model (e.g. a ``BertModel``
    encoder folder, which transformers would load with a fresh LM head): one line naming it."""
    archs = list(getattr(model_config, "architectures", None) or [])
    kind = getattr(model_config, "model_type", "?")
    if archs and not set(archs) & _causal_lm_classes():
        raise CheckpointError(
            f"{where} is a {kind} model ({', '.join(archs)}), not a causal language model: "
            "peakprobe probes next-token models (e.g. *ForCausalLM)"
        )
    if getattr(model_config, "is_encoder_decoder", False):
        raise CheckpointError(f"{where} is an encoder-decoder {kind} model, not a causal language model")


def check_model(model: torch.nn.Module, data: EvalData, where: str = "the model") -> None:
    """Before any forward pass: the model is a causal LM and every token id of ``data`` has a
    row in its embedding table (for a model that states its architecture and embeddings, as
    transformers' models do). One-line ``CheckpointError`` otherwise."""
    if getattr(model, "config", None) is not None:
        check_causal_lm(model.config, where)
    get = getattr(model, "get_input_embeddings", None)
    rows = getattr(get() if callable(get) else None, "num_embeddings", None)
    top = int(data.input_ids.max()) if data.input_ids.numel() else -1
    if rows is not None and top >= rows:
        raise CheckpointError(
            f"the evaluation tokens reach id {top} but {where}'s embedding table has {rows} rows: "
            "the tokenizer does not fit this model (pass --tokenizer with the model's own)"
        )


def uses_attention_interface(model: torch.nn.Module) -> bool:
    """Whether ``model`` routes its attention through transformers' attention interface (then
    ``hooks.attach`` probes it, with the attribution); otherwise its sdpa calls are probed."""
    return bool(getattr(model, "_supports_attention_backend", False))


def probe_model(model, data: EvalData, config: SweepConfig, *, progress: bool = False, desc: str = "",
                forward=None) -> pd.DataFrame:
    """Per-site statistics of one loaded model over all evaluation windows (tidy frame), plus the
    attribution metrics (sensitivity, curvature, gain, log_beta_opt) over the first
    ``config.attribution.windows`` windows when ``config.attribution.active``.

    A Hugging Face model is probed through its attention interface (``hooks.attach``); any other
    model, or one given ``forward`` (``forward(input_ids)`` -> logits), through its calls of
    ``F.scaled_dot_product_attention`` (``hooks.sdpa``; statistics only). The model is checked
    first (``check_model``): nothing runs on a model that cannot take the windows."""
    check_model(model, data, desc or type(model).__name__)
    hf = forward is None and uses_attention_interface(model)
    n_batches = -(-data.n_windows // config.batch_size)
    with (attach(model, config.probe) if hf else attach_sdpa(model, config.probe)) as probe:
        for ids, mask, pos in tqdm(
            data.batches(config.batch_size), total=n_batches, desc=desc, leave=False,
            disable=not progress, unit="batch",
        ):
            if hf:
                probe.run_batch(ids, mask, pos)
            else:
                probe.run_batch(ids, mask, pos, forward=forward)
        if hf:  # head roles: one forward over the diagnostic batch of repeated random tokens
            probe.run_roles()
        frame = probe.to_frame()
    if not config.attribution.active:
        return frame
    if not hf:
        warnings.warn(f"the attribution (gains) needs transformers' attention interface; "
                      f"{type(model).__name__} is probed for its statistics only", AttributionWarning,
                      stacklevel=2)
        return frame
    subset = list(data.batches(config.batch_size, config.attribution.windows))  # (b, T) each
    extra = attribute(model, subset, heads=config.attribution.heads, progress=progress,
                      desc=f"{desc} attribution".strip())
    routers = router_gains(model, subset, progress=progress, desc=f"{desc} router gains".strip())
    frame = pd.concat([frame, extra] + ([routers] if len(routers) else []), ignore_index=True)
    return frame.sort_values(["site_kind", "layer", "head", "metric"], kind="stable").reset_index(drop=True)


def tidy_frame(frame: pd.DataFrame, seq: CheckpointSequence, ckpt: Checkpoint) -> pd.DataFrame:
    """``probe_model``'s frame with the checkpoint's columns in front: what a parquet holds (the
    sweep and live probing write exactly this)."""
    frame = frame.copy()
    frame.insert(0, "model", seq.name)
    frame.insert(1, "revision", ckpt.revision)
    frame.insert(2, "step", int(ckpt.step))
    frame.insert(3, "tokens", -1 if ckpt.tokens is None else int(ckpt.tokens))
    frame.insert(4, "tau", float("nan") if ckpt.tau is None else float(ckpt.tau))
    return frame
