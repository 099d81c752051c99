"""The engine thread: one thread owns the Engine (it is not thread-safe) and steps it while
any request is unfinished; the asyncio side hands it work and reads results through `Stream`s.

    HTTP handler --submit()--> inbox --(engine thread)--> add_request / step / stream_delta
         ^                                                         |
         +------ Stream (asyncio.Queue, filled thread-safely) <----+
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from dataclasses import dataclass, field

from eaglekv.config import SamplingParams
from eaglekv.core import Output, StreamDelta
from eaglekv.engine.request import Req
from eaglekv.errors import KVIndexError

log = logging.getLogger("eaglekv.server")


@dataclass
class Finished:
    output: Output


@dataclass
class Failed:
    error: Exception


@dataclass
class Stream:
    """One request's results as they come: StreamDelta items, then Finished or Failed."""
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    req: Req | None = None
    submitted_at: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None

    def put(self, item) -> None:   # engine thread
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)

    async def __aiter__(self):
        """Deltas until the request ends; raises the engine's error if it failed."""
        while True:
            item = await self.queue.get()
            if isinstance(item, Failed):
                raise item.error
            if isinstance(item, Finished):
                return
            yield item

    async def result(self) -> Output:
        while True:
            item = await self.queue.get()
            if isinstance(item, Failed):
                raise item.error
            if isinstance(item, Finished):
                return item.output


class EngineLoop:
    def __init__(self, engine, on_step=None):
        owner = getattr(engine, "_engine_loop", None)
        if owner is not None and not owner._stop.is_set():
            raise RuntimeError("this engine is already driven by a running EngineLoop; "
                               "shut that one down first (one thread may step an engine)")
        engine._engine_loop = self
        self.engine = engine
        self.on_step = on_step            # called on the engine thread after every step
        self._inbox: queue.Queue = queue.Queue()
        self._streams: dict[int, tuple[Req, Stream]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="eaglekv-engine", daemon=True)

    # ---- any thread ----------------------------------------------------------------------------
    def start(self) -> "EngineLoop":
        self._thread.start()
        return self

    def shutdown(self) -> None:
        self._stop.set()
        self._inbox.put(None)
        if self._thread.is_alive():
            self._thread.join(timeout=30)
        if getattr(self.engine, "_engine_loop", None) is self:
            self.engine._engine_loop = None

    def call(self, fn) -> concurrent.futures.Future:
        """Run `fn(engine)` on the engine thread, between steps."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._inbox.put((fn, fut))
        return fut

    # ---- asyncio side ----------------------------------------------------------------------
    async def submit(self, prompt, params: SamplingParams) -> Stream:
        """Queue a request; raises the engine's RequestError here if it is refused."""
        if not self._thread.is_alive():
            raise RuntimeError("the engine thread is not running")
        stream = Stream(asyncio.get_running_loop())

        def add(engine):
            req = engine.add_request(prompt, params)
            stream.req = req
            self._streams[req.rid] = (req, stream)
            return req
        await asyncio.wrap_future(self.call(add))
        return stream

    def abort(self, stream: Stream) -> None:
        """The client went away: stop the request and free its KV (no-op once finished)."""
        def stop(engine):
            entry = self._streams.pop(stream.req.rid, None)
            if entry is not None:
                engine.abort(entry[0])
        self.call(stop)

    # ---- engine thread -------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            self._drain(block=not self.engine.has_unfinished())
            if self._stop.is_set() or not self.engine.has_unfinished():
                continue
            try:
                self._step()
            except Exception as e:      # a bug outside the step itself: fail what is in
                log.exception("engine loop iteration crashed")   # flight, keep the thread
                self._fail_all(e)

    def _step(self) -> None:
        error = None
        try:
            self.engine.step()
        except KVIndexError as e:       # the engine failed that batch's requests and goes on
            log.error("step failed: %s", e)
            error = e
        except Exception as e:          # anything else: fail every request in flight
            log.exception("engine step crashed")
            self._fail_all(e)
            return
        self._publish(error)
        if self.on_step is not None:
            self.on_step(self.engine)

    def _fail_all(self, error: Exception) -> None:
        for rid, (req, stream) in list(self._streams.items()):
            try:
                self.engine.abort(req)
            finally:
                stream.put(Failed(error))
                del self._streams[rid]

    def _drain(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while item is not None:
            fn, fut = item
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn(self.engine))
                except Exception as e:  # noqa: BLE001 - handed to the caller
                    fut.set_exception(e)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _publish(self, error: Exception | None) -> None:
        for rid, (req, stream) in list(self._streams.items()):
            if req.finish_reason == "error":
                stream.put(Failed(error or RuntimeError("request failed")))
                del self._streams[rid]
                continue
            delta: StreamDelta | None = req.stream_delta()
            if delta is not None:
                if stream.first_token_at is None and delta.token_ids:
                    stream.first_token_at = time.perf_counter()
                stream.put(delta)
            if req.finished:
                stream.put(Finished(req.to_output()))
                del self._streams[rid]
