"""The replica's HTTP server: ``create_app(engine, tokenizer, server_args)`` builds a FastAPI app
serving the OpenAI-compatible API, SGLang's native API and the operational endpoints over any
``EngineClient`` (the in-process engine or a Ray replica).

Errors: a ``/v1/...`` path answers ``{"object": "error", "message", "type", "param", "code"}``,
every other path ``{"error": {"message", ...}}``, an unknown path (404) or method (405) too;
bad input is a 400 whose message starts with the field's name (``messages[0].role``). A
client that goes away mid-request has its request aborted (KV freed).
"""

from __future__ import annotations

import json
import os
import time
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass, field

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CollectorRegistry, generate_latest
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException

from .. import __version__
from ..router.config import CACHE_EPOCH_HEADER
from . import native_api, openai_api, tokenize_api
from .engine_protocol import HEALTH_CHECK_TIMEOUT_S, EngineClient
from .api_errors import APIError, bad_request, unavailable
from .generation import ServingContext, prepare_off_loop_if_large
from .metrics import COUNTERS, EXPOSITION_CONTENT_TYPE, GAUGES, EngineMetrics
from .openai_serving import chat_completions, completions

HEALTH_PATHS = ("/health", "/health_generate")
# Open without the API key, as SGLang's: load balancers and Prometheus scrape them; neither
# generates text for a client (a health check's one token is discarded) nor reveals any.
OPEN_PATHS = (*HEALTH_PATHS, "/metrics")


@dataclass
class ServerArgs:
    """What the HTTP layer itself needs; ``extra`` (scheduler arguments and such) is only
    reported by /server_info."""

    model_path: str
    served_model_name: str | None = None
    tokenizer_path: str | None = None
    host: str = "127.0.0.1"
    port: int = 30000
    api_key: str | None = None
    max_queued_requests: int | None = None
    tool_call_parser: str | None = None  # tool_calls.PARSERS key (--tool-call-parser)
    chat_template: str | None = None  # a Jinja chat template's text, instead of the model's
    health_check_timeout: float = HEALTH_CHECK_TIMEOUT_S
    context_len: int | None = None  # None: the engine's max_context_len
    replica: str = "0"
    extra: dict = field(default_factory=dict)

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model_path


def error_body(path: str, err: APIError) -> dict:
    if path.startswith("/v1/"):
        return {"object": "error", "message": err.message, "type": err.err_type,
                "param": err.param, "code": err.code}
    return {"error": {"message": err.message, "code": err.code, "param": err.param}}


def validation_error(e: ValidationError) -> APIError:
    """The most specific pydantic error (the first of the deepest: for a union, the member
    that got furthest) as a 400 naming its field as the hand-written checks do
    (``messages[0].content``; union-member tags dropped)."""
    errors = e.errors()
    err = max(errors, key=lambda x: len(x["loc"]))
    name = ""
    for part in err["loc"]:
        if isinstance(part, int):
            name += f"[{part}]"
        elif not any(c in part for c in "[]-") and not part[:1].isupper() and part not in (
                "str", "int", "float", "bool", "list", "dict", "none"):  # (a model: a tag)
            name += f".{part}" if name else part
    name = name or "body"
    return bad_request(f"{name}: {err['msg']}", param=name)


async def parse_body(request: Request, model: type[BaseModel]):
    raw = await request.body()
    try:
        data = json.loads(raw) if raw else None
    except (ValueError, RecursionError) as e:  # nested too deep: RecursionError
        raise bad_request(f"body: malformed JSON ({e})", param="body") from None
    if not isinstance(data, dict):
        raise bad_request("body: must be a JSON object", param="body")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise validation_error(e) from None


class ApiKeyMiddleware:
    """Every path but ``OPEN_PATHS`` (health checks, metrics) needs ``Authorization: Bearer
    <key>`` (pure ASGI, so streaming and disconnects pass through untouched)."""

    def __init__(self, app, api_key: str):
        self.app, self.expected = app, f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            headers = dict(scope.get("headers") or [])
            if headers.get(b"authorization") != self.expected:
                err = APIError(401, "Missing or invalid API key (Authorization: Bearer ...)",
                               err_type="AuthenticationError")
                response = JSONResponse(error_body(scope["path"], err), status_code=401)
                return await response(scope, receive, send)
        await self.app(scope, receive, send)


class CacheEpochHeader:
    """Adds the engine's cache epoch to every answer (pure ASGI, as ApiKeyMiddleware), so the
    router sees a restart or a flush on the next answer, not at its next health check."""

    def __init__(self, app, engine: EngineClient):
        self.app, self.engine = app, engine

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def send_with_epoch(message):
            epoch = self.engine.cache_epoch() if message["type"] == "http.response.start" else ""
            if epoch:  # (none while a replica restarts: it has no cache)
                header = (CACHE_EPOCH_HEADER.encode(), epoch.encode())
                message = {**message, "headers": [*message.get("headers", []), header]}
            await send(message)

        await self.app(scope, receive, send_with_epoch)


def _model_config(model_path: str) -> dict:
    try:
        with open(os.path.join(model_path, "config.json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def create_app(engine: EngineClient, tokenizer, server_args: ServerArgs) -> FastAPI:
    """A FastAPI app over ``engine``. ``tokenizer`` is a transformers tokenizer of the model."""
    info = engine.server_info()
    args = server_args
    if args.chat_template is not None:  # --chat-template: the model's own does not fit
        tokenizer.chat_template = args.chat_template
    registry = CollectorRegistry()  # this app's own, so several replicas in a process coexist
    ctx = ServingContext(
        engine, tokenizer, args.model_name,
        context_len=args.context_len or info.get("max_context_len") or tokenizer.model_max_length,
        vocab_size=info.get("vocab_size") or len(tokenizer),
        max_queued_requests=args.max_queued_requests,
        metrics=EngineMetrics(registry, args.model_name, args.replica),
        tool_call_parser=args.tool_call_parser, pool_tokens=info.get("max_total_num_tokens"))
    state = {"shutting_down": False}

    @asynccontextmanager
    async def lifespan(_app):
        yield
        state["shutting_down"] = True

    app = FastAPI(title="radixray", version=__version__, lifespan=lifespan)
    app.state.ctx = ctx
    if args.api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=args.api_key)
    app.add_middleware(CacheEpochHeader, engine=engine)
    _add_error_handlers(app)
    _add_operations_routes(app, ctx, args, registry, state)
    _add_api_routes(app, ctx, args)
    return app


def _add_error_handlers(app: FastAPI) -> None:
    """Every error in the API's error shape (``error_body``), a crash too (a 500)."""
    @app.exception_handler(APIError)
    async def _api_error(request: Request, err: APIError):
        return JSONResponse(error_body(request.url.path, err), status_code=err.status,
                            headers=err.headers)

    @app.exception_handler(HTTPException)  # no such route (404) or method (405)
    async def _http_error(request: Request, exc: HTTPException):
        detail = (f"Not Found: {request.url.path} is not an endpoint of this server"
                  if exc.status_code == 404 and exc.detail == "Not Found" else exc.detail)
        err = APIError(exc.status_code, detail)
        return JSONResponse(error_body(request.url.path, err), status_code=exc.status_code,
                            headers=exc.headers)

    @app.exception_handler(Exception)
    async def _internal(request: Request, e: Exception):
        err = APIError(500, f"internal error: {type(e).__name__}: {e}",
                       err_type="InternalServerError")
        return JSONResponse(error_body(request.url.path, err), status_code=500)


def _add_operations_routes(app: FastAPI, ctx: ServingContext, args: ServerArgs,
                           registry: CollectorRegistry, state: dict) -> None:
    """Health, model and server info, the cache flush, aborts and metrics."""
    engine = ctx.engine
    model_cfg = _model_config(args.model_path)

    async def _health() -> Response:
        if state["shutting_down"]:
            return PlainTextResponse("shutting down", status_code=503)
        ok = await engine.health_check(args.health_check_timeout)
        return Response(status_code=200) if ok else PlainTextResponse(
            "engine not ready or not making progress", status_code=503)

    app.add_api_route("/health", _health, methods=["GET", "HEAD"])
    app.add_api_route("/health_generate", _health, methods=["GET", "HEAD"])

    def _model_info():
        return {"model_path": args.model_path,
                "tokenizer_path": args.tokenizer_path or args.model_path,
                "served_model_name": args.model_name, "is_generation": True,
                "architectures": model_cfg.get("architectures"),
                "model_type": model_cfg.get("model_type"),
                "max_context_len": ctx.context_len}

    def _server_info():
        out = {k: v for k, v in asdict(args).items() if k != "extra"}
        out["api_key"] = "***" if args.api_key else None
        out.update(args.extra)
        out.update(engine.server_info())
        if not out.get("tokenizer_path"):  # as SGLang: the model's own when none was given
            out["tokenizer_path"] = args.tokenizer_path or args.model_path
        out["version"] = __version__
        return out

    for path in ("/model_info", "/get_model_info"):
        app.add_api_route(path, _model_info, methods=["GET"])
    for path in ("/server_info", "/get_server_info"):
        app.add_api_route(path, _server_info, methods=["GET"])

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def _flush():
        try:
            flushed = await engine.flush_cache()
        except RuntimeError as e:  # restarting (a marked 503) or stopped: not a 500
            raise unavailable(e) from None
        if flushed:
            return PlainTextResponse("Cache flushed.")
        return PlainTextResponse("Cache not flushed: requests are running; retry when idle.",
                                 status_code=400)

    @app.post("/abort_request")
    async def _abort(request: Request):
        return await native_api.abort_request(ctx, await request.body())

    @app.get("/metrics")
    async def _metrics():
        stats = engine.stats()
        ctx.metrics.update_scheduler_stats({k: v for k, v in stats.items()
                                            if k in GAUGES or k in COUNTERS})
        return Response(generate_latest(registry), media_type=EXPOSITION_CONTENT_TYPE)


def _add_api_routes(app: FastAPI, ctx: ServingContext, args: ServerArgs) -> None:
    """The models list, the tokenizer and generation: SGLang's native API and OpenAI's."""
    model_card = {"id": args.model_name, "object": "model", "created": int(time.time()),
                  "owned_by": "radixray", "root": args.model_path,
                  "max_model_len": ctx.context_len}

    @app.get("/v1/models")
    async def _models():
        return {"object": "list", "data": [model_card]}

    @app.get("/v1/models/{model:path}")  # OpenAI's "retrieve model"; a path may hold "/"
    async def _model(model: str):
        openai_api.check_model(model, ctx, args.model_path)
        return model_card

    async def _tokenize(request: Request):
        body = await parse_body(request, tokenize_api.TokenizeRequest)
        if body.model is not None:
            openai_api.check_model(body.model, ctx, args.model_path)
        return await prepare_off_loop_if_large(request, tokenize_api.tokenize, body, ctx)

    async def _detokenize(request: Request):
        body = await parse_body(request, tokenize_api.DetokenizeRequest)
        if body.model is not None:
            openai_api.check_model(body.model, ctx, args.model_path)
        return await prepare_off_loop_if_large(request, tokenize_api.detokenize, body, ctx)

    for prefix in ("", "/v1"):
        app.add_api_route(prefix + "/tokenize", _tokenize, methods=["POST"])
        app.add_api_route(prefix + "/detokenize", _detokenize, methods=["POST"])

    @app.post("/generate")
    async def _generate(request: Request):
        body = await parse_body(request, native_api.GenerateReqInput)
        return await native_api.generate(request, ctx, body)

    @app.post("/v1/completions")
    async def _completions(request: Request):
        body = await parse_body(request, openai_api.CompletionRequest)
        openai_api.check_model(body.model, ctx, args.model_path)
        return await completions(request, ctx, body)

    @app.post("/v1/chat/completions")
    async def _chat(request: Request):
        body = await parse_body(request, openai_api.ChatCompletionRequest)
        openai_api.check_model(body.model, ctx, args.model_path)
        return await chat_completions(request, ctx, body)
