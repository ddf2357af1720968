"""Routing a Hugging Face model's attention calls through one function of ours, and back.

transformers selects a model's attention function by name (``AttentionInterface``) and builds
its masks with the mask function registered under the same name (``AttentionMaskInterface``).
``route_attention`` registers a function under a fresh name, registers the original
implementation's mask function beside it (a name without one would receive no padding mask at
all), switches the model to it, and restores the model and both registries on exit, also when
the block raises. ``call_original`` hands a call on to the implementation the model had. The
probes (``interface``) and the tempered model of the attribution both route through here.
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from ..vocab import PeakprobeError

_names = itertools.count()


class UnsupportedModelError(PeakprobeError):
    """The model's softmaxes cannot be reached through the attention interface."""


def original_attention(model: torch.nn.Module) -> Callable | None:
    """The attention function ``model`` uses now; None for eager (each module's own
    ``eager_attention_forward``)."""
    name = model.config._attn_implementation or "eager"
    return None if name == "eager" else ALL_ATTENTION_FUNCTIONS[name]


def call_original(delegate: Callable | None, module: torch.nn.Module, owner: type, query, key, value,
                  attention_mask, **kwargs):
    """Run one attention call with the original implementation ``delegate``; None: the eager
    function of ``owner``'s modeling file (``owner`` is the attention module's class)."""
    if delegate is not None:
        return delegate(module, query, key, value, attention_mask, **kwargs)
    eager = getattr(sys.modules[owner.__module__], "eager_attention_forward", None)
    if eager is None:
        raise UnsupportedModelError(f"{owner.__name__} has no eager_attention_forward to delegate to")
    return eager(module, query, key, value, attention_mask, **kwargs)


@contextmanager
def route_attention(model: torch.nn.Module, fn: Callable, prefix: str = "peakprobe") -> Iterator[str]:
    """Every attention call of ``model`` goes to ``fn`` (the attention interface's signature)
    inside the block; yields the registered name. On exit the model's own implementation and
    both registries are restored."""
    original = model.config._attn_implementation or "eager"
    name = f"{prefix}_{next(_names)}"
    AttentionInterface.register(name, fn)
    AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[original])
    try:
        model.set_attn_implementation(name)
        yield name
    finally:
        if model.config._attn_implementation == name:
            model.set_attn_implementation(original)
        AttentionInterface._global_mapping.pop(name, None)
        AttentionMaskInterface._global_mapping.pop(name, None)
