"""llama.cpp through llama-cpp-python's low-level API: model, context, capture, state, sampling."""

from .capture import Capture, PoolCapture
from .context import LIVE, MAX_LANES, WORKSPACE, Context, Pool, lane_seqs
from .model import Model
from .sampling import Sampler, SamplingParams

__all__ = ["Capture", "Context", "LIVE", "MAX_LANES", "Model", "Pool", "PoolCapture", "Sampler", "SamplingParams",
           "WORKSPACE", "lane_seqs"]  # fmt: skip
