"""llama.cpp through llama-cpp-python's low-level API: model, context, capture, state, sampling."""

from .capture import Capture
from .context import LIVE, WORKSPACE, Context
from .model import Model
from .sampling import Sampler, SamplingParams

__all__ = ["Capture", "Context", "LIVE", "Model", "Sampler", "SamplingParams", "WORKSPACE"]
