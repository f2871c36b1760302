"""The OpenAI-compatible FastAPI app: ``/v1/completions`` and ``/v1/chat/completions`` (streamed as server-sent
events, or not), ``/v1/models``, ``/health`` and ``/metrics`` (Prometheus text).

Every request body is read as bytes and checked here (size, UTF-8, JSON, then the parameters), so each
mistake is one HTTP 4xx with OpenAI's JSON error naming it; nothing of a refused request reaches the engine.
A prompt that does not fit the model's context with its ``max_tokens`` is a 400 (so is anything else the
engine's ``add_request`` refuses), a full queue a 429, a failed engine a 503. A client that goes away before
its completion ends (a closed stream, or a dropped connection while a non-streamed request runs) has its
request aborted, which frees its KV blocks at once.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from megamoe.serving import QueueFullError, SamplingParams
from megamoe.serving.http import protocol
from megamoe.serving.http.detokenizer import IncrementalDetokenizer, cut_at_stop
from megamoe.serving.http.engine_loop import EngineFailed, EngineLoop, RequestStream, ServerBusy
from megamoe.serving.http.metrics import render_metrics
from megamoe.serving.http.protocol import APIError, ChatCompletionRequest, CompletionRequest
from megamoe.serving.http.tokenizer import ChatTemplateError, ServingTokenizer

__all__ = ["ENDPOINTS", "MAX_BODY_BYTES", "build_app"]

logger = logging.getLogger(__name__)

# path -> the request model of its body (None: a GET)
ENDPOINTS = {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest, "/v1/models": None,
             "/health": None, "/metrics": None}
MAX_BODY_BYTES = 16 << 20
_DISCONNECT_POLL_S = 0.5        # how often a non-streamed request checks that its client is still there


def build_app(loop: EngineLoop, tokenizer: ServingTokenizer, *, model_name: str, vocab_size: int,
              context_length: int | None) -> FastAPI:
    """The app over a started :class:`EngineLoop`. ``context_length``: the most positions (prompt + new tokens)
    of one request, None when the model declares none."""
    app = FastAPI(title="megamoe", docs_url=None, redoc_url=None, openapi_url=None)
    server = _Server(loop, tokenizer, model_name, vocab_size, context_length)

    @app.exception_handler(APIError)
    async def api_error(request: Request, error: APIError):
        if error.status in (429, 503):
            loop.stats.reject(error.status)
        return JSONResponse(error.body(), status_code=error.status)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, error: Exception):
        logger.exception("internal error on %s", request.url.path)
        return JSONResponse(APIError(500, f"internal server error: {type(error).__name__}: {error}",
                                     kind="server_error").body(), status_code=500)

    @app.get("/health")
    async def health():
        if not loop.alive:
            raise APIError(503, f"the engine stopped: {loop.error}", kind="server_error")
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        card = {"id": model_name, "object": "model", "created": server.created, "owned_by": "megamoe"}
        if context_length is not None:
            card["max_model_len"] = context_length
        return {"object": "list", "data": [card]}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(render_metrics(loop.metrics(), loop.stats),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await server.handle(request, await _body(request, CompletionRequest))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await server.handle(request, await _body(request, ChatCompletionRequest))

    return app


async def _body(request: Request, model):
    """The request body as ``model``: APIError for a body too large, not UTF-8, not JSON or with bad fields."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise APIError(413, f"the request body ({declared} bytes) is larger than {MAX_BODY_BYTES} bytes")
    raw = await request.body()
    if len(raw) > MAX_BODY_BYTES:
        raise APIError(413, f"the request body is larger than {MAX_BODY_BYTES} bytes")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise APIError(400, f"the request body is not UTF-8: byte {error.start} is invalid ({error.reason})") from None
    try:
        document = json.loads(text)
    except json.JSONDecodeError as error:
        raise APIError(400, f"the request body is not valid JSON: {error}") from None
    return protocol.parse_request(model, document)


class _Server:
    def __init__(self, loop: EngineLoop, tokenizer: ServingTokenizer, model_name: str, vocab_size: int,
                 context_length: int | None):
        self.loop = loop
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.vocab_size = vocab_size
        self.context_length = context_length
        self.created = protocol.now()

    # --- request -> engine -------------------------------------------------------------------------------------
    def prompt_ids(self, body) -> list[int]:
        if isinstance(body, ChatCompletionRequest):
            try:
                ids = self.tokenizer.encode_chat(body.message_dicts(), add_generation_prompt=body.add_generation_prompt)
            except ChatTemplateError as error:
                raise APIError(400, str(error), param="messages") from None
        elif isinstance(body.prompt, str):
            ids = self.tokenizer.encode(body.prompt)
        else:
            ids = list(body.prompt)
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise APIError(400, f"the prompt holds token ids {bad[:4]} outside the model's vocabulary "
                                    f"[0, {self.vocab_size})", param="prompt")
        if not ids:
            raise APIError(400, "the prompt holds no token", param="prompt")
        return ids

    def max_tokens(self, body, prompt_len: int) -> int:
        """The request's max_tokens (its default where absent), checked against the context."""
        asked = body.max_tokens
        if isinstance(body, ChatCompletionRequest) and body.max_completion_tokens is not None:
            asked = body.max_completion_tokens
        limit = self.context_length
        if limit is not None and prompt_len >= limit:
            raise APIError(400, f"the prompt has {prompt_len} tokens, and this model's context is {limit} tokens: "
                                f"shorten the prompt to at most {limit - 1} tokens", param="prompt",
                           code="context_length_exceeded")
        if asked is None:
            if isinstance(body, CompletionRequest):
                asked = protocol.DEFAULT_COMPLETION_MAX_TOKENS
            else:
                asked = limit - prompt_len if limit is not None else protocol.DEFAULT_CHAT_MAX_TOKENS
            return min(asked, limit - prompt_len) if limit is not None else asked
        if limit is not None and prompt_len + asked > limit:
            raise APIError(400, f"the prompt ({prompt_len} tokens) with max_tokens {asked} needs {prompt_len + asked} "
                                f"positions, more than this model's context of {limit}: ask for at most "
                                f"{limit - prompt_len} tokens", param="max_tokens", code="context_length_exceeded")
        return asked

    def sampling_params(self, body, prompt_len: int) -> SamplingParams:
        outside = [t for t in body.stop_token_ids if not 0 <= t < self.vocab_size]
        if outside:
            raise APIError(400, f"stop_token_ids {outside[:4]} are outside the model's vocabulary [0, "
                                f"{self.vocab_size})", param="stop_token_ids")
        try:
            return SamplingParams(temperature=body.temperature, top_k=body.top_k, top_p=body.top_p,
                                  seed=body.seed if body.seed is not None else 0,
                                  max_tokens=self.max_tokens(body, prompt_len),
                                  stop_token_ids=tuple(dict.fromkeys([*self.tokenizer.eos_token_ids,
                                                                      *body.stop_token_ids])),
                                  stop=tuple(body.stop), logprobs=body.wants_logprobs())
        except APIError:
            raise
        except ValueError as error:
            raise APIError(400, f"invalid parameters: {error}") from None

    async def handle(self, request: Request, body):
        if body.model is not None and body.model != self.model_name:
            raise APIError(404, f"the model {body.model!r} does not exist: this server serves {self.model_name!r} "
                                "(GET /v1/models)", param="model", code="model_not_found")
        prompt_ids = self.prompt_ids(body)
        params = self.sampling_params(body, len(prompt_ids))
        try:
            stream = self.loop.submit(prompt_ids, params)
        except ServerBusy as error:
            raise APIError(429, str(error), kind="rate_limit_error") from None
        except EngineFailed as error:
            raise APIError(503, str(error), kind="server_error") from None
        try:
            await stream.accepted()
        except QueueFullError as error:
            raise APIError(429, f"the queue is full: {error}", kind="rate_limit_error") from None
        except EngineFailed as error:
            raise APIError(503, str(error), kind="server_error") from None
        except ValueError as error:
            raise APIError(400, str(error)) from None
        chat = isinstance(body, ChatCompletionRequest)
        if body.stream:
            return StreamingResponse(self.events(request, stream, body, chat), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        return JSONResponse(await self.complete(request, stream, body, chat))

    # --- engine -> response ------------------------------------------------------------------------------------
    def _response_id(self, stream: RequestStream, chat: bool) -> str:
        return f"{'chatcmpl' if chat else 'cmpl'}-{stream.request_id}"

    def _token_texts(self, ids) -> list[str]:
        return [self.tokenizer.token_text(t) for t in ids]

    async def complete(self, request: Request, stream: RequestStream, body, chat: bool) -> dict:
        """Wait for the whole completion; abort it if the client disconnects meanwhile."""
        ids: list[int] = []
        logprobs: list[float] = []
        output = None
        while output is None or not output.finished:
            output = await self._next_or_disconnect(request, stream)
            if output is None:                  # the client went away
                self.loop.abort(stream.request_id)
                raise APIError(499, "the client closed the connection")
            ids.extend(output.new_token_ids)
            logprobs.extend(output.logprobs or ())
        text, stopped = cut_at_stop(self.tokenizer.decode(ids), stream.params.stop)
        reason = "stop" if stopped else _openai_reason(output.finish_reason)
        choice = {"index": 0, "finish_reason": reason}
        tokens = self._token_texts(ids) if body.wants_logprobs() else None
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
            choice["logprobs"] = protocol.chat_logprobs(tokens, logprobs) if tokens is not None else None
        else:
            choice["text"] = text
            choice["logprobs"] = protocol.completion_logprobs(tokens, logprobs, 0) if tokens is not None else None
        return {"id": self._response_id(stream, chat), "object": "chat.completion" if chat else "text_completion",
                "created": protocol.now(), "model": self.model_name, "choices": [choice],
                "usage": protocol.usage(len(stream.prompt_ids), len(ids), output.num_cached_tokens)}

    async def _next_or_disconnect(self, request: Request, stream: RequestStream):
        """The stream's next output, or None once the client has disconnected."""
        task = asyncio.ensure_future(stream.next())
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=_DISCONNECT_POLL_S)
                if done:
                    try:
                        return task.result()
                    except EngineFailed as error:
                        raise APIError(503, str(error), kind="server_error") from None
                if await request.is_disconnected():
                    return None
        finally:
            task.cancel()

    async def events(self, request: Request, stream: RequestStream, body, chat: bool) -> AsyncIterator[str]:
        """The server-sent events of a streamed completion: ``data: {chunk}`` lines, then ``data: [DONE]``."""
        finished = False
        detokenizer = IncrementalDetokenizer(self.tokenizer.decode, stream.params.stop)
        base = {"id": self._response_id(stream, chat), "object": "chat.completion.chunk" if chat else "text_completion",
                "created": protocol.now(), "model": self.model_name}

        def chunk(text: str, reason: str | None, ids=(), logprobs=(), role: bool = False) -> str:
            choice = {"index": 0, "finish_reason": reason}
            tokens = self._token_texts(ids) if body.wants_logprobs() and ids else None
            if chat:
                choice["delta"] = ({"role": "assistant", "content": text} if role else
                                   {"content": text} if text or reason is None else {})
                choice["logprobs"] = protocol.chat_logprobs(tokens, list(logprobs)) if tokens else None
            else:
                choice["text"] = text
                choice["logprobs"] = (protocol.completion_logprobs(tokens, list(logprobs), len(detokenizer.text))
                                      if tokens else None)
            return _sse({**base, "choices": [choice]})

        try:
            if chat:
                yield chunk("", None, role=True)
            generated, cached = 0, 0
            while not finished:
                try:
                    output = await self._next_or_disconnect(request, stream)
                except APIError as error:       # the engine failed: nothing left to abort
                    yield _sse(error.body())
                    finished = True
                    return
                if output is None:              # the client went away (finally: abort)
                    return
                generated += len(output.new_token_ids)
                cached = output.num_cached_tokens
                text = detokenizer.add(output.new_token_ids)
                finished = output.finished or detokenizer.stopped
                if finished and not output.finished:
                    self.loop.abort(stream.request_id)          # a stop string the engine has not yet seen
                if finished:
                    text += detokenizer.finish()
                    reason = "stop" if detokenizer.stopped else _openai_reason(output.finish_reason)
                    yield chunk(text, reason, output.new_token_ids, output.logprobs or ())
                elif text or (body.wants_logprobs() and output.new_token_ids):
                    yield chunk(text, None, output.new_token_ids, output.logprobs or ())
            if body.include_usage:
                yield _sse({**base, "choices": [], "usage": protocol.usage(len(stream.prompt_ids), generated, cached)})
            yield "data: [DONE]\n\n"
        finally:
            if not finished:                    # the client went away mid-stream
                self.loop.abort(stream.request_id)


def _openai_reason(reason: str | None) -> str:
    return "length" if reason == "length" else "stop"


def _sse(document: dict) -> str:
    return f"data: {json.dumps(document, ensure_ascii=False)}\n\n"
