"""Serving: continuous batching over a paged KV cache with prefix caching and per-request sampling.

One concept per module: :mod:`~megamoe.serving.config` (EngineConfig), :mod:`~megamoe.serving.sampling_params`,
:mod:`~megamoe.serving.request` (request state, RequestOutput), :mod:`~megamoe.serving.block_pool` (block ids,
reference counts), :mod:`~megamoe.serving.prefix_cache` (chained block hashes, LRU),
:mod:`~megamoe.serving.paged_kv_cache` (per-layer pools and the attention's per-step views),
:mod:`~megamoe.serving.scheduler`, :mod:`~megamoe.serving.engine`, :mod:`~megamoe.serving.metrics`."""

from megamoe.serving.config import EngineConfig
from megamoe.serving.engine import Engine
from megamoe.serving.errors import QueueFullError
from megamoe.serving.metrics import EngineMetrics
from megamoe.serving.request import RequestOutput
from megamoe.serving.sampling_params import SamplingParams

__all__ = ["Engine", "EngineConfig", "EngineMetrics", "QueueFullError", "RequestOutput", "SamplingParams"]
