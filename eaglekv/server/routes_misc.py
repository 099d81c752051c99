"""The routes around generation: /health, /version, /v1/models (and one model by id),
Prometheus /metrics, /tokenize and /detokenize."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from eaglekv.version import __version__
from eaglekv.server.http_errors import answers_500
from eaglekv.server.protocol import DetokenizeRequest, TokenizeRequest
from eaglekv.server.state import Server

router = APIRouter()


@router.get("/health")
async def health():
    return {"status": "ok"}


@router.get("/version")
async def version():
    return {"version": __version__}


@router.get("/v1/models")
async def models(st: Server):
    return {"object": "list", "data": [st.model_card()]}


@router.get("/v1/models/{model_id:path}")
async def model(model_id: str, st: Server):
    st.check_model(model_id)
    return st.model_card()


@router.get("/metrics")
async def prometheus(st: Server):
    return PlainTextResponse(generate_latest(st.metrics.registry),
                             media_type=CONTENT_TYPE_LATEST)


@router.post("/tokenize")
@answers_500
async def tokenize(body: TokenizeRequest, st: Server):
    st.check_model(body.model)
    body.check()
    if body.messages is not None:
        ids = await st.tokenization.chat(body.conversation(), body.add_generation_prompt)
    else:
        ids = await st.tokenization.encode(body.prompt, body.add_special_tokens)
    return {"count": len(ids), "max_model_len": st.max_model_len, "tokens": ids}


@router.post("/detokenize")
@answers_500
async def detokenize(body: DetokenizeRequest, st: Server):
    st.check_model(body.model)
    body.check_vocab(st.loop.engine.model_config.vocab_size)
    return {"prompt": await st.tokenization.decode(body.tokens)}
