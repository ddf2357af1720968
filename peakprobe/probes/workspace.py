"""Block-sized scratch tensors kept from one block of logits to the next (``Workspace``).

On CPU a fresh tensor of a few MiB is returned to the system when freed, and the next one
faults its pages in again: for the probe's short elementwise passes that costs more than the
arithmetic. The block passes (``rows``, ``attention``) therefore write their block-sized
temporaries into named slots of a ``Workspace`` that the probe owns for as long as it is
attached. A slot's tensor is valid until the next request of the same slot: callers keep only
reductions (fresh, row-sized tensors) beyond it.
"""

from __future__ import annotations

import math

import torch


class Workspace:
    """Named flat buffers, grown on demand; ``take`` returns a contiguous view of one."""

    def __init__(self) -> None:
        self._flat: dict[tuple[str, torch.dtype, torch.device], torch.Tensor] = {}

    def take(self, slot: str, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        """An uninitialised contiguous tensor of ``shape`` with ``like``'s dtype and device."""
        n = math.prod(shape)
        key = (slot, like.dtype, like.device)
        flat = self._flat.get(key)
        if flat is None or flat.numel() < n:
            flat = self._flat[key] = torch.empty(n, dtype=like.dtype, device=like.device)
        return flat[:n].view(shape)

    def clear(self) -> None:
        """Free every buffer (the probe detaches)."""
        self._flat.clear()


def take(work: Workspace | None, slot: str, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    """``work.take(...)``, or a fresh tensor without a workspace."""
    if work is None:
        return torch.empty(shape, dtype=like.dtype, device=like.device)
    return work.take(slot, tuple(shape), like)
