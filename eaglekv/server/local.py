"""An in-process server on a free port (uvicorn in a thread), for tests and benchmarks."""

from __future__ import annotations

import threading
import time

from eaglekv.server.app import create_app
from eaglekv.server.loop import EngineLoop
from eaglekv.server.settings import ServerConfig


class LocalServer:
    def __init__(self, engine, model_name: str, default_max_tokens: int = 256, **server_options):
        """`server_options`: further ServerConfig fields (api_key, max_request_bytes, ...)."""
        import uvicorn
        self.loop = EngineLoop(engine).start()
        self.app = create_app(self.loop, ServerConfig(model_name=model_name,
                                                      default_max_tokens=default_max_tokens,
                                                      **server_options))
        self.uv = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=0,
                                                log_level="warning"))
        self.thread = threading.Thread(target=self.uv.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 30
        while not self.uv.started:
            if time.time() > deadline or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)
        port = self.uv.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"

    def client(self, api_key: str = "none", **kw):
        """The official openai client on this server (no retries: tests see every error)."""
        import openai
        return openai.OpenAI(base_url=self.url + "/v1", api_key=api_key, max_retries=0, **kw)

    def metric(self, name: str) -> float:
        """The sum of every sample of /metrics whose line starts with `name`."""
        import httpx
        total = 0.0
        for line in httpx.get(self.url + "/metrics").text.splitlines():
            if line.startswith(name) and not line.startswith("#"):
                total += float(line.rsplit(" ", 1)[1])
        return total

    def wait_idle(self, timeout: float = 60) -> None:
        """Until no request is left; then the engine's books must balance (allocator full)."""
        deadline = time.time() + timeout
        while self.on_engine(lambda e: e.has_unfinished()):
            if time.time() > deadline:
                raise AssertionError(f"requests still running after {timeout} s")
            time.sleep(0.05)
        self.on_engine(lambda e: e.check_memory())

    def on_engine(self, fn):
        """Run fn(engine) on the engine thread and return its result."""
        return self.loop.call(fn).result(timeout=300)

    @property
    def stopped(self) -> bool:
        return not self.thread.is_alive()

    def stop(self) -> None:
        self.uv.should_exit = True
        self.thread.join(timeout=30)
        self.loop.shutdown()
