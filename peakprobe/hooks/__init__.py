"""Finding the softmax sites of a Hugging Face model and attaching probes to them."""

from .interface import Probe, UnsupportedModelError, attach

__all__ = ["Probe", "UnsupportedModelError", "attach"]
