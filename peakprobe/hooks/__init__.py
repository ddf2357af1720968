"""Finding the softmax sites of a Hugging Face model and attaching probes to them."""

from ..probes.rows import CompileError
from .interface import Probe, UnsupportedModelError, attach

__all__ = ["CompileError", "Probe", "UnsupportedModelError", "attach"]
