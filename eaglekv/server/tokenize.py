"""Text to token ids and back for the server, on worker threads of their own: a long prompt or
a slow chat template never holds the engine thread, so the streams in flight keep going while
a large body is tokenized (the `tokenizers` library releases the GIL while it encodes, and
the workers run at a lower CPU priority than the engine)."""

from __future__ import annotations

import asyncio
import os
import threading
from concurrent.futures import ThreadPoolExecutor

from eaglekv.server.protocol import RequestRefused


WORKER_NICE = 10   # below the engine thread: tokenizing a huge prompt must not slow decoding


def _lower_priority() -> None:
    """Linux schedules threads one by one, so a worker thread can be niced alone."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WORKER_NICE)
    except (AttributeError, OSError):   # not Linux, or not allowed: run at normal priority
        pass


class Tokenization:
    def __init__(self, tokenizer, chat_template: str | None = None, workers: int = 2):
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="eaglekv-tok",
                                        initializer=_lower_priority)

    def _need_tokenizer(self, param: str) -> None:
        if self.tokenizer is None:
            raise RequestRefused("this model has no tokenizer: send token ids", param)

    async def _run(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    # ---- worker threads ------------------------------------------------------------------------
    def encode_sync(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """What Engine.encode does with a text prompt."""
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def render_sync(self, conversation: list[dict], add_generation_prompt: bool = True) -> str:
        return self.tokenizer.apply_chat_template(
            conversation, chat_template=self.chat_template, tokenize=False,
            add_generation_prompt=add_generation_prompt)

    def chat_sync(self, conversation: list[dict], add_generation_prompt: bool = True
                  ) -> list[int]:
        """The conversation through the chat template (the server's --chat-template, else the
        tokenizer's), then encoded without adding special tokens (the template has them)."""
        return self.encode_sync(self.render_sync(conversation, add_generation_prompt), False)

    # ---- asyncio side --------------------------------------------------------------------------
    async def prompts(self, prompts: list) -> list[list[int]]:
        """Each prompt (a string, or token ids kept as they are) as token ids."""
        out = []
        for p in prompts:
            if isinstance(p, str):
                self._need_tokenizer("prompt")
                p = await self._run(self.encode_sync, p)
            out.append(list(p))
        return out

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self._need_tokenizer("prompt")
        return await self._run(self.encode_sync, text, add_special_tokens)

    async def chat(self, conversation: list[dict], add_generation_prompt: bool = True
                   ) -> list[int]:
        self._need_tokenizer("messages")
        return await self._run(self.chat_sync, conversation, add_generation_prompt)

    async def decode(self, ids: list[int]) -> str:
        self._need_tokenizer("tokens")
        return await self._run(self.tokenizer.decode, ids)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
