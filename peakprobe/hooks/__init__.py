"""Finding the softmax sites of a Hugging Face model and attaching probes to them."""

from .interface import Probe, ProbeConfig, UnsupportedModelError, attach

__all__ = ["Probe", "ProbeConfig", "UnsupportedModelError", "attach"]
