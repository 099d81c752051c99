"""eaglekv: EAGLE-family speculative decoding on a guarded paged KV cache."""

from eaglekv.config import EngineConfig, SamplingParams, SpecConfig
from eaglekv.core import Output, SpecStats, StreamDelta, TokenLogprob
from eaglekv.engine import Engine
from eaglekv.errors import ConfigError, KVIndexError, ModelLoadError, RequestError
from eaglekv.version import __version__

__all__ = ["ConfigError", "Engine", "EngineConfig", "KVIndexError", "ModelLoadError", "Output",
           "RequestError", "SamplingParams", "SpecConfig", "SpecStats", "StreamDelta",
           "TokenLogprob", "__version__"]
