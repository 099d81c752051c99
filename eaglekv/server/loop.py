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
    last_token_at: float | None = None

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
    def __init__(self, engine, on_change=None, on_tokens=None):
        owner = getattr(engine, "_engine_loop", None)
        if owner is not None and not owner._stop.is_set():
            raise RuntimeError("this engine is already driven by a running EngineLoop; "
                               "shut that one down first (one thread may step an engine)")
        engine._engine_loop = self
        self.engine = engine
        # engine-thread hooks: on_change(engine) after every step and after any work handed
        # in between steps (submits, aborts), so gauges follow the engine even while it idles;
        # on_tokens(stream, now) when a delta with tokens goes to a stream
        self.on_change, self.on_tokens = on_change, on_tokens
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
        return (await self.submit_many([(prompt, params)]))[0]

    async def submit_many(self, requests: list[tuple], group: int | None = None) -> list[Stream]:
        """Queue (prompt, params) requests in one visit to the engine thread, all or none: if
        the engine refuses one, those already added are aborted and the error raised here.
        `group` ties them together for the scheduler's fairness rule (one HTTP call)."""
        if not self._thread.is_alive():
            raise RuntimeError("the engine thread is not running")
        aio = asyncio.get_running_loop()
        streams = [Stream(aio) for _ in requests]

        def add(engine):
            added = []
            try:
                for stream, (prompt, params) in zip(streams, requests):
                    req = engine.add_request(prompt, params, group=group)
                    stream.req = req
                    added.append(req)
                    self._streams[req.rid] = (req, stream)
            except BaseException:
                for req in added:
                    self._streams.pop(req.rid, None)
                    engine.abort(req)
                raise
        await asyncio.wrap_future(self.call(add))
        return streams

    def abort(self, stream: Stream) -> None:
        """The client went away: stop the request and free its KV (no-op once finished)."""
        if stream.req is None:   # never reached the engine
            return

        def stop(engine):
            entry = self._streams.pop(stream.req.rid, None)
            if entry is not None:
                engine.abort(entry[0])
        self.call(stop)

    # ---- engine thread -------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            if self._drain(block=not self.engine.has_unfinished()):
                self._changed()
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
        self._changed()

    def _changed(self) -> None:
        if self.on_change is not None:
            try:
                self.on_change(self.engine)
            except Exception:  # noqa: BLE001 - a metrics bug must not stop the engine
                log.exception("on_change hook failed")

    def _fail_all(self, error: Exception) -> None:
        for rid, (req, stream) in list(self._streams.items()):
            try:
                self.engine.abort(req)
            finally:
                stream.put(Failed(error))
                del self._streams[rid]

    def _drain(self, block: bool) -> bool:
        """Run the work handed in; True if there was any."""
        try:
            item = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return False
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
                return True
        return True

    def _publish(self, error: Exception | None) -> None:
        now = time.perf_counter()
        for rid, (req, stream) in list(self._streams.items()):
            if req.finish_reason == "error":   # its own error (a poisoned request), else the batch's
                failure = getattr(req, "error", None) or error or RuntimeError("request failed")
                stream.put(Failed(failure))
                del self._streams[rid]
                continue
            delta: StreamDelta | None = req.stream_delta()
            if delta is not None:
                if delta.token_ids:
                    if self.on_tokens is not None:
                        self.on_tokens(stream, now)
                    elif stream.first_token_at is None:
                        stream.first_token_at = now
                stream.put(delta)
            if req.finished:
                stream.put(Finished(req.to_output()))
                del self._streams[rid]
