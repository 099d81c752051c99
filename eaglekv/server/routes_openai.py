"""/v1/completions and /v1/chat/completions, streaming or not. Each route checks its request,
says how its chunks and choices look, and hands the rest to `generate.generate`."""

from __future__ import annotations

from fastapi import APIRouter, Request

from eaglekv.server.generate import begin, generate
from eaglekv.server.http_errors import answers_500
from eaglekv.server.logprobs import LogprobFormatter
from eaglekv.server.protocol import ChatCompletionRequest, CompletionRequest, RequestRefused
from eaglekv.server.state import Server

COMPLETIONS_DEFAULT_MAX_TOKENS = 16   # the OpenAI API's default for /v1/completions

router = APIRouter()


@router.post("/v1/completions")
@answers_500
async def completions(body: CompletionRequest, request: Request, st: Server):
    begin(st, request, body, "cmpl")
    prompts = body.prompts()
    st.check_total(len(prompts), body.n)
    rid, created = request.state.rid, request.state.created
    fmt = LogprobFormatter(st.loop.engine.tokenizer) if body.logprobs is not None else None

    def chunk(text, finish_reason, index=0, logprobs=None):
        return {"id": rid, "object": "text_completion", "created": created,
                "model": st.model_name, "choices": [{"index": index, "text": text,
                                                     "logprobs": logprobs,
                                                     "finish_reason": finish_reason}]}
    offsets: dict[int, int] = {}

    def block(i, lps):   # each choice's text offsets run on across its chunks
        b, offsets[i] = fmt.completion(lps, offsets.get(i, 0))
        return b

    def choice(i, o):
        return chunk(o.text, o.finish_reason, i,
                     fmt.completion(o.logprobs)[0] if fmt else None)["choices"][0]
    return await generate(st, request, body, "completions", "text_completion",
                          lambda: st.tokenization.prompts(prompts),
                          COMPLETIONS_DEFAULT_MAX_TOKENS, chunk, choice,
                          logprobs=block if fmt else None)


@router.post("/v1/chat/completions")
@answers_500
async def chat_completions(body: ChatCompletionRequest, request: Request, st: Server):
    begin(st, request, body, "chatcmpl")
    st.check_total(1, body.n)
    if st.loop.engine.tokenizer is None:
        raise RequestRefused("this model has no tokenizer, so no chat template; use "
                             "/v1/completions with token ids", "messages")
    conversation = body.conversation()
    rid, created = request.state.rid, request.state.created
    fmt = LogprobFormatter(st.loop.engine.tokenizer) if body.logprobs else None

    def chunk(text, finish_reason, index=0, logprobs=None):
        return {"id": rid, "object": "chat.completion.chunk", "created": created,
                "model": st.model_name,
                "choices": [{"index": index, "delta": {"content": text} if text else {},
                             "logprobs": logprobs, "finish_reason": finish_reason}]}

    def first(i):
        c = chunk("", None, i)
        c["choices"][0]["delta"] = {"role": "assistant", "content": ""}
        return c

    def choice(i, o):
        return {"index": i, "message": {"role": "assistant", "content": o.text},
                "logprobs": fmt.chat(o.logprobs) if fmt else None,
                "finish_reason": o.finish_reason}

    async def ids():
        return [await st.tokenization.chat(conversation)]
    return await generate(st, request, body, "chat", "chat.completion", ids,
                          st.config.default_max_tokens, chunk, choice, first=first,
                          logprobs=(lambda i, lps: fmt.chat(lps)) if fmt else None)
