"""An in-process server on a free port (uvicorn in a thread), for tests and benchmarks."""

from __future__ import annotations

import threading
import time

from eaglekv.server.app import create_app
from eaglekv.server.loop import EngineLoop


class LocalServer:
    def __init__(self, engine, model_name: str, default_max_tokens: int = 256):
        import uvicorn
        self.loop = EngineLoop(engine).start()
        self.app = create_app(self.loop, model_name, default_max_tokens)
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

    def on_engine(self, fn):
        """Run fn(engine) on the engine thread and return its result."""
        return self.loop.call(fn).result(timeout=300)

    def stop(self) -> None:
        self.uv.should_exit = True
        self.thread.join(timeout=30)
        self.loop.shutdown()
