"""The one transformers utility every stage shares: silencing transformers' own progress bars
while peakprobe's show the work (loading in the sweep, saving in the toy trainers)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def quiet_transformers_progress() -> Iterator[None]:
    """Silence transformers' loading/saving progress bars for the block, then restore them."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()
