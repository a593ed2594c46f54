"""The HTTP server: OpenAI-compatible routes (aiohttp) over `AsyncLLM`. When a failed step
kills the engine, in-flight and new requests get a 500 and /health a 503 (serve_process.py
then exits the process). `qwen-jax serve` runs it through serve_process.py.

Parsing and response shapes live in protocol.py and outputs.py (the Responses API in responses.py);
a client that disconnects cancels its handler (`handler_cancellation=True`), which closes the
request's streams and so aborts it in the engine at once."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import time
import uuid
from pathlib import Path

from aiohttp import web

from serving.engine.exceptions import EngineDeadError, QueueFullError, RequestFailedError
from serving.entrypoints.openai import http_policy
from serving.entrypoints.openai import protocol as proto
from serving.entrypoints.openai.config import ServerConfig
from serving.entrypoints.openai.errors import APIError, error_body
from serving.entrypoints.openai.lora_routes import LoRAModels
from serving.entrypoints.openai.outputs import Echo, Job, make_echo, merge, sse
from serving.entrypoints.openai.responses import ResponseStore, create_response, get_response
from serving.entrypoints.openai.structured_requests import reply_format
from serving.entrypoints.openai.tokenizer_info import tokenizer_info
from serving.metrics.prometheus import CONTENT_TYPE, log_throughput, metrics_for
from serving.parsers.chat_reply import ReplyFormat
from serving.parsers.reasoning import reasoning_parser_class
from serving.parsers.tool_parsers import CALL_END, CALL_START, tool_parser_class

logger = logging.getLogger("qwen_jax.server")
LOG = web.RequestKey("log", dict)
REQUEST_ID = web.RequestKey("request_id", str)


def json_error(status: int, message: str, param: str | None = None,
               headers: dict | None = None) -> web.Response:
    return web.json_response(error_body(status, message, param), status=status,
                             headers=headers)


class OpenAIServer:
    def __init__(self, llm, config: ServerConfig):
        self.llm, self.config = llm, config
        engine = llm.engine
        self.model_name = (config.served_model_name or engine.config.model
                           or Path(engine.model_path).name)
        self.max_model_len = engine.max_model_len
        self.vocab_size = engine.model_config.vocab_size
        template = config.chat_template_text()
        self.tokenizer = (llm.tokenizer if template is None or llm.tokenizer is None
                          else llm.tokenizer.with_chat_template(template))
        self.default_sampling = engine.default_sampling
        self.max_body = int(config.max_request_body_mb * 2**20)
        self.metrics = metrics_for(llm, self.model_name, config.metrics_prefix)
        self.reasoning_parser = (reasoning_parser_class(config.reasoning_parser)
                                 if config.reasoning_parser else None)
        self.tool_parser = (tool_parser_class(config.tool_call_parser)
                            if config.tool_call_parser else None)
        self.draining = False
        self.responses = ResponseStore()  # the Responses API's stored responses
        self.num_active = 0  # handlers running: a dead engine's server exits once it is 0
        self.created = int(time.time())
        self.loras = LoRAModels(self)  # the model names requests may give; /v1/models

    # ---- plumbing ----------------------------------------------------------------------
    @web.middleware
    async def middleware(self, request: web.Request, handler):
        started = time.perf_counter()
        self.num_active += 1
        try:
            return await self._handle(request, handler, started)
        finally:
            self.num_active -= 1

    async def _handle(self, request: web.Request, handler, started: float):
        try:
            request[REQUEST_ID], bad_id = http_policy.request_id(request.headers), None
        except ValueError as exc:  # answered with a fresh id
            request[REQUEST_ID], bad_id = uuid.uuid4().hex, exc
        request[LOG] = {"request_id": request[REQUEST_ID]}
        try:
            if bad_id is not None:
                raise APIError(400, str(bad_id), param=http_policy.REQUEST_ID_HEADER)
            response = await self._guarded(request, handler)
        except APIError as exc:
            response = json_error(exc.status, exc.message, exc.param, exc.headers)
        except web.HTTPException as exc:  # unknown route, wrong method, body too large
            message = (f"route {request.method} {request.path} not found" if exc.status == 404
                       else exc.reason)
            allow = {k: v for k, v in exc.headers.items() if k == "Allow"}
            response = json_error(exc.status, message, headers=allow)
        except (asyncio.CancelledError, ConnectionError):
            request[LOG]["status"] = "disconnected"
            self._log_request(request, started)
            self.metrics.http_responses.labels(self.model_name, "499").inc()
            raise
        except Exception:
            logger.exception("internal error on %s %s", request.method, request.path)
            response = json_error(500, "internal server error")
        status = request[LOG].setdefault("status", response.status)
        self._log_request(request, started)
        code = "499" if status == "disconnected" else str(response.status)
        self.metrics.http_responses.labels(self.model_name, code).inc()
        return response

    async def on_response_prepare(self, request: web.Request, response) -> None:
        """Headers every response carries, streamed ones too (set before they are sent)."""
        if REQUEST_ID in request:
            response.headers[http_policy.REQUEST_ID_HEADER] = request[REQUEST_ID]
        response.headers.update(http_policy.cors_headers(request.headers.get("Origin"),
                                                         self.config.allowed_origins))

    async def _guarded(self, request: web.Request, handler):
        path = request.path
        if request.method == "OPTIONS" and "Access-Control-Request-Method" in request.headers:
            return self._preflight(request)  # browsers send no credentials here
        key = self.config.api_key
        if key and path.startswith(("/v1", "/tokenize", "/detokenize")):
            self._check_api_key(request, key)
        if self.llm.dead is not None and path not in ("/health", "/metrics"):
            raise APIError(500, f"engine is dead ({self.llm.dead!r}); the server is exiting "
                                "for its supervisor to restart it")
        if self.draining and path not in ("/health", "/metrics"):
            raise APIError(503, "server is shutting down",
                           headers={"Retry-After": str(self.config.retry_after)})
        if request.content_length is not None and request.content_length > self.max_body:
            raise APIError(413, f"request body has {request.content_length} bytes; at most "
                                f"{self.max_body} (--max-request-body-mb)", param="body")
        return await handler(request)

    @staticmethod
    def _check_api_key(request: web.Request, key: str) -> None:
        if not http_policy.api_key_matches(request.headers.get("Authorization", ""), key):
            raise APIError(401, "missing or invalid API key (Authorization: Bearer <key>)")

    def _preflight(self, request: web.Request) -> web.Response:
        origin = request.headers.get("Origin")
        headers = http_policy.preflight_headers(
            origin, self.config.allowed_origins,
            request.headers.get("Access-Control-Request-Headers"))
        if headers is None:
            raise APIError(403, f"origin {origin!r} is not allowed (--allowed-origins)",
                           param="Origin")
        return web.Response(status=204, headers=headers)

    def _log_request(self, request: web.Request, started: float) -> None:
        info = request[LOG]
        extra = " ".join(f"{k}={v}" for k, v in info.items() if k != "status")
        logger.info("%s %s %s %.3fs %s", request.method, request.path,
                    info.get("status", "?"), time.perf_counter() - started, extra)

    async def _json(self, request: web.Request) -> dict:
        try:
            data = await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise APIError(413, f"request body is larger than {self.max_body} bytes "
                                "(--max-request-body-mb)", param="body") from None
        return proto.parse_json(data)

    def _check_model(self, model: str | None):  # -> its LoRARequest (None: the base)
        return self.loras.resolve(model)

    def _need_tokenizer(self):
        if self.tokenizer is None:
            raise APIError(400, "this model has no tokenizer files: send token ids")
        return self.tokenizer

    async def _encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        tokenizer = self._need_tokenizer()
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(None, tokenizer.encode, text, add_special_tokens)

    async def _render_chat(self, messages, tools, kwargs) -> list[int]:
        tokenizer = self._need_tokenizer()
        kwargs = {**self.config.default_chat_template_kwargs, **kwargs}

        def render():
            return tokenizer.apply_chat_template(messages, tokenize=True, tools=tools, **kwargs)
        try:
            return await asyncio.get_running_loop().run_in_executor(None, render)
        except (ValueError, TypeError, RecursionError) as exc:
            raise APIError(400, f"messages: {exc}", param="messages") from None
        except Exception as exc:  # jinja2 errors from the checkpoint's template
            raise APIError(400, f"chat template failed on these messages: {exc}",
                           param="messages") from None

    def _note_unknown(self, request: web.Request, req: proto.ParsedRequest) -> None:
        if req.unknown_fields:
            logger.warning("%s: ignoring unknown fields %s", request.path,
                           ", ".join(map(repr, req.unknown_fields[:20])))

    # ---- generation routes -------------------------------------------------------------
    async def completions(self, request: web.Request) -> web.StreamResponse:
        req = proto.parse_completion(await self._json(request), self.vocab_size,
                                     self.default_sampling)
        req.lora_request = self._check_model(req.model)
        self._note_unknown(request, req)
        await self._check_constraint(req)
        prompts = [p if isinstance(p, list) else await self._encode(p) for p in req.prompts]
        echo = make_echo(req, req.prompts, prompts, self.tokenizer)
        return await self._generate(request, req, prompts, "cmpl", "prompt", echo=echo)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        req = proto.parse_chat(await self._json(request), self.vocab_size, self.default_sampling)
        req.lora_request = self._check_model(req.model)
        self._note_unknown(request, req)
        reply = self._reply_format(req)
        await self._check_constraint(req)
        ids = await self._render_chat(req.messages, req.tools, req.template_kwargs)
        return await self._generate(request, req, [ids], "chatcmpl", "messages", reply)

    # ---- tools and structured outputs ------------------------------------------------
    def _reply_format(self, req: proto.ParsedRequest) -> ReplyFormat:
        constrained = req.tool_request is not None and req.tool_request.constrained
        tag_ids = {tag: self._need_tokenizer().backend.token_to_id(tag)
                   for tag in (CALL_START, CALL_END)} if constrained else {}
        auto = self.tool_parser if self.config.enable_auto_tool_choice else None
        return reply_format(req, self.reasoning_parser, auto, tag_ids)

    async def _check_constraint(self, req: proto.ParsedRequest) -> None:
        """Compile the request's grammar once up front: a bad schema, regex or grammar is a
        400 with llguidance's reason before anything runs."""
        if req.structured is None:
            return
        grammars = self.llm.engine.grammars
        if grammars is None:
            raise APIError(400, "structured outputs need the model's tokenizer files",
                           param=req.structured_field)
        if self.reasoning_parser is not None and req.messages is not None:
            req.structured = dataclasses.replace(req.structured, reasoning=True)
        loop = asyncio.get_running_loop()
        error = await loop.run_in_executor(None, grammars.validate, req.structured)
        if error:
            raise APIError(400, f"{req.structured_field}: {error}", param=req.structured_field)

    async def _generate(self, request, req: proto.ParsedRequest, prompts: list[list[int]],
                        kind: str, prompt_param: str, reply: ReplyFormat | None = None,
                        echo: Echo | None = None) -> web.StreamResponse:
        job, first, outputs = await self._start(request, req, prompts, kind, prompt_param,
                                                reply, echo)
        try:
            if req.stream:
                return await self._stream(request, job, first, outputs)
            job.add(*first)
            while (item := await self._engine_call(outputs.__anext__())) is not None:
                job.add(*item)
        finally:
            await outputs.aclose()
        request[LOG].update(job.log_fields())
        return web.json_response(job.response())

    async def _start(self, request, req: proto.ParsedRequest, prompts: list[list[int]],
                     kind: str, prompt_param: str, reply: ReplyFormat | None = None,
                     echo: Echo | None = None):
        """Submit the prompts: (their Job, the first (prompt, output), the merged rest)."""
        for ids in prompts:
            if not ids:
                raise APIError(400, f"{prompt_param} is empty: it must contain at least one "
                                    "token", param=prompt_param)
        params = [proto.sampling_params(req, len(ids), self.max_model_len, prompt_param)
                  for ids in prompts]
        job = Job(kind=kind, request_id=f"{kind}-{request[REQUEST_ID]}",
                  model=self.loras.model_name(req.lora_request), req=req, prompts=prompts,
                  params=params, metrics=self.metrics, reply=reply or ReplyFormat(), echo=echo)
        request[LOG].update(prompt_tokens=sum(map(len, prompts)))
        # Engine ids stay unique even when clients reuse an X-Request-Id.
        engine_id = f"{job.request_id}-{uuid.uuid4().hex[:8]}"
        gens = [self.llm.generate({"prompt_token_ids": ids}, p,
                                  request_id=f"{engine_id}-{i}", priority=req.priority,
                                  lora_request=req.lora_request)
                for i, (ids, p) in enumerate(zip(prompts, params))]
        outputs = merge(gens)
        try:
            first = await self._engine_call(outputs.__anext__())
        except BaseException:
            await outputs.aclose()
            raise
        return job, first, outputs

    async def _engine_call(self, awaitable):
        """Await the engine; its rejections become HTTP errors. None when a stream ends."""
        try:
            return await awaitable
        except StopAsyncIteration:
            return None
        except QueueFullError as exc:
            raise APIError(503, f"server overloaded: {exc}; retry later",
                           headers={"Retry-After": str(self.config.retry_after)}) from None
        except (EngineDeadError, RequestFailedError) as exc:
            raise APIError(500, str(exc)) from None
        except ValueError as exc:
            raise APIError(400, str(exc)) from None

    async def _stream(self, request, job: Job, first, outputs) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                               "Cache-Control": "no-cache"})
        try:
            await response.prepare(request)
            for event in job.sse_chunks(*first):
                await response.write(event)
            async for index, output in outputs:
                for event in job.sse_chunks(index, output):
                    await response.write(event)
            if job.req.include_usage:
                await response.write(sse(job.usage_chunk()))
        except asyncio.CancelledError:
            raise
        except ConnectionError:  # the client left: aiohttp closes the stream quietly
            request[LOG]["status"] = "disconnected"
            return response
        except Exception as exc:  # headers are out: report in-band, then end the stream
            logger.exception("stream %s failed", job.request_id)
            status = exc.status if isinstance(exc, APIError) else 500
            await response.write(sse(error_body(status, str(exc))))
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        request[LOG].update(job.log_fields())
        return response

    # ---- other routes ------------------------------------------------------------------
    async def health(self, request: web.Request) -> web.Response:
        """200 while serving; with data-parallel replicas each one's state (200 while any
        serves)."""
        ok, body = self.llm.health() if hasattr(self.llm, "health") else (True, None)
        status = 200 if ok and self.llm.dead is None and not self.draining else 503
        return web.json_response(body, status=status) if body else web.Response(status=status)

    async def prometheus(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(), headers={"Content-Type": CONTENT_TYPE})

    async def tokenize(self, request: web.Request) -> web.Response:
        body = await self._json(request)
        self._check_model(proto.read_str(body, "model", None))
        if "messages" in body:
            req = proto.parse_chat({"messages": body["messages"],
                                    **{k: body[k] for k in ("chat_template_kwargs",
                                                            "add_generation_prompt", "tools")
                                       if k in body}}, self.vocab_size)
            ids = await self._render_chat(req.messages, req.tools, req.template_kwargs)
        else:
            prompt = proto.read_str(body, "prompt", None)
            if prompt is None:
                raise APIError(400, "prompt (a string) or messages is required", param="prompt")
            ids = await self._encode(prompt, proto.read_bool(body, "add_special_tokens", True))
        strs = None
        if proto.read_bool(body, "return_token_strs", False):
            strs = [self.tokenizer.id_to_token(t) for t in ids]
        return web.json_response({"count": len(ids), "max_model_len": self.max_model_len,
                                  "tokens": ids, "token_strs": strs})

    async def detokenize(self, request: web.Request) -> web.Response:
        body = await self._json(request)
        self._check_model(proto.read_str(body, "model", None))
        tokens = proto.read_token_ids(body.get("tokens"), "tokens", self.vocab_size, 10**7)
        text = self._need_tokenizer().decode(tokens, skip_special_tokens=False)
        return web.json_response({"prompt": text})

    # ---- background ------------------------------------------------------------------
    async def log_throughput(self, app: web.Application):
        task = (asyncio.create_task(log_throughput(self.metrics, self.llm, self.config.log_interval,
                                                   logger)) if self.config.log_interval else None)
        self.llm.step_listeners.append(self.metrics.on_step)
        yield
        self.llm.step_listeners.remove(self.metrics.on_step)
        if task is not None:
            task.cancel()


STATE = web.AppKey("state", OpenAIServer)


def build_app(llm, config: ServerConfig | None = None) -> web.Application:
    """The aiohttp application; serve it with `handler_cancellation=True` so a client
    disconnect aborts its request."""
    server = OpenAIServer(llm, config or ServerConfig())
    app = web.Application(middlewares=[server.middleware], client_max_size=server.max_body)
    app[STATE] = server
    app.cleanup_ctx.append(server.log_throughput)
    app.on_response_prepare.append(server.on_response_prepare)
    app.on_startup.insert(0, server.loras.register_static)  # before anything starts
    app.add_routes([
        web.post("/v1/completions", server.completions),
        web.post("/v1/chat/completions", server.chat_completions),
        web.post("/v1/responses", functools.partial(create_response, server)),
        web.get("/v1/responses/{response_id}", functools.partial(get_response, server)),
        *server.loras.routes(),  # /v1/models; loading adapters at run time if allowed
        web.get("/health", server.health),
        web.get("/metrics", server.prometheus),
        web.post("/tokenize", server.tokenize),
        web.post("/detokenize", server.detokenize),
    ] + ([web.get("/tokenizer_info", functools.partial(tokenizer_info, server))]
         if server.config.enable_tokenizer_info_endpoint else []))
    return app
