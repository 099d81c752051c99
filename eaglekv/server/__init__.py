"""OpenAI-compatible server over one Engine (`eaglekv serve`)."""

from eaglekv.server.app import create_app
from eaglekv.server.loop import EngineLoop

__all__ = ["EngineLoop", "create_app"]
