"""The server's ASGI middleware, outermost first, each a plain ASGI app:

- `RequestIdMiddleware`: every response carries `x-request-id` (the client's, or a new one);
  the routes use it in the response id, as vLLM does. Counts responses by status.
- `BodyLimitMiddleware`: a body over `max_request_bytes` is answered 413 before any of it is
  parsed (by Content-Length when given, else while it streams in), so no route, tokenizer or
  engine ever sees it.
- `ApiKeyMiddleware`: with an API key set, /v1/*, /tokenize and /detokenize need
  `Authorization: Bearer <key>` (compared in constant time); 401 otherwise. /health, /version
  and /metrics stay open, as in vLLM.
"""

from __future__ import annotations

import hmac
import uuid

from eaglekv.server.http_errors import error_body

PROTECTED = ("/v1/", "/tokenize", "/detokenize")


def _header(scope, name: bytes) -> str | None:
    for k, v in scope.get("headers", ()):
        if k.lower() == name:
            return v.decode("latin-1")
    return None


class RequestIdMiddleware:
    def __init__(self, app, metrics=None):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        rid = _header(scope, b"x-request-id") or uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = rid

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                message.setdefault("headers", [])
                message["headers"] = list(message["headers"]) + [
                    (b"x-request-id", rid.encode("latin-1", "replace"))]
                if self.metrics is not None:
                    self.metrics.http.labels(status=str(message["status"])).inc()
            await send(message)
        await self.app(scope, receive, send_with_id)


class BodyLimitMiddleware:
    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    def _too_large(self, size: str) -> object:
        return error_body(413, f"request body of {size} bytes exceeds the limit of "
                          f"{self.max_bytes} bytes (--max-request-bytes)", param=None)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        length = _header(scope, b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            return await self._too_large(length)(scope, receive, send)
        # read the whole body here (at most max_bytes), then replay it to the app
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                return await self._too_large(f"more than {self.max_bytes}")(scope, receive, send)
            chunks.append(chunk)
            more = message.get("more_body", False)
        body, replayed = b"".join(chunks), False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()   # later calls wait for the disconnect, as usual
        await self.app(scope, replay, send)


class ApiKeyMiddleware:
    def __init__(self, app, api_key: str):
        self.app, self.expected = app, f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not scope["path"].startswith(PROTECTED) \
                or scope["method"] == "OPTIONS":
            return await self.app(scope, receive, send)
        given = (_header(scope, b"authorization") or "").encode("latin-1", "replace")
        if not hmac.compare_digest(given, self.expected):
            why = "missing" if not given else "incorrect"
            return await error_body(401, f"{why} API key: send 'Authorization: Bearer <key>' "
                                    f"with the key the server was started with (--api-key)",
                                    headers={"WWW-Authenticate": "Bearer"})(scope, receive, send)
        await self.app(scope, receive, send)
