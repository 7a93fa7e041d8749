"""The gateway's HTTP side: an OpenAI-compatible server on 127.0.0.1 (an ephemeral port) in the
training process, uvicorn in its own thread, with one session per episode.

Each episode's session key is its api key (`Authorization: Bearer <key>`). Routes:
GET /v1/models, POST /v1/chat/completions (what `openai.AsyncOpenAI(base_url=...)` calls) and
GET /health. Every misuse is a 4xx in OpenAI's error shape with a message saying what to
change: a Host other than 127.0.0.1 or a loopback name 421 (DNS rebinding), a body that is not
`Content-Type: application/json` 415, no or an unknown key 401, the key of an ended session
404, a wrong model name 404, a malformed body 400, a conversation too large for the episode's
token limit 400 (counted before it is rendered), a second call while one is in flight 409, a
call past the episode's turn or token limit 400, a body over the size limit 413. Each is
counted (`stats`) and logged. Connections have tiller's read deadline and cap
(`tiller.serve.listen`); parsing and rendering run in worker threads, off the event loop.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import socket
import threading
import time
from collections import Counter, OrderedDict
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from tiller.gateway.session import Plan, Session
from tiller.rollout.agent_loop import Actor, EpisodeLimits
from tiller.rollout.chat import ChatFormat
from tiller.rollout.episode import RUN_FAILURES
from tiller.rollout.trajectory import TrajectoryBuilder
from tiller.serve import listen
from tiller.serve.app import CatchAll
from tiller.serve.guard import Guard, Hosts
from tiller.serve.listen import ConnectionGuard, ConnectionLimits
from tiller.serve.openai_routes import (
    TEMPLATE_ERRORS,
    chat_choice,
    chat_inputs,
    chat_reply,
    check_model_and_stop,
    parse_chat,
    render_error,
    template_message,
)
from tiller.serve.protocol import APIError, ChatCompletionRequest, ChatMessage
from tiller.serve.server import MAX_JSON_VALUES

logger = logging.getLogger(__name__)

MODEL = "policy"  # the model name the gateway serves (the run's policy)
SAMPLING_FIELDS = frozenset({"temperature", "top_p", "top_k", "seed"})
ENDED_KEYS_KEPT = 65536  # keys of ended sessions remembered, to tell "ended" from "unknown"
HOST = "127.0.0.1"
# keep-alive 30 s: the openai client's pooled connections outlive an episode's tool calls
LIMITS = ConnectionLimits(read_timeout_s=10.0, keep_alive_s=30, max_connections=512)


class Gateway:
    """The sessions and the server. `start()` binds 127.0.0.1:0 and serves in a thread;
    `open`/`close_session` bracket each episode; `close()` stops the server."""

    def __init__(self, *, model: str = MODEL, max_body_bytes: int = 4 << 20,
                 max_json_values: int = MAX_JSON_VALUES, start_timeout_s: float = 30.0,
                 limits: ConnectionLimits = LIMITS):
        self.model = model
        self.max_json_values = max_json_values  # a call's JSON values (400 above)
        self.start_timeout_s = start_timeout_s
        self.limits = limits
        self.sessions: dict[str, Session] = {}
        self.ended: OrderedDict[str, None] = OrderedDict()
        self.lock = threading.Lock()  # sessions, ended, and each session's busy/ended flags
        self.counts: Counter[str] = Counter()
        self._logged: set[Any] = set()  # kinds of warning already logged once
        self.app = self._build_app(max_body_bytes)
        self._server: Any = None
        self.connections: ConnectionGuard | None = None  # the server's refusal counts
        self._thread: threading.Thread | None = None
        self.base_url = ""

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> Gateway:
        sock = socket.socket()
        sock.bind((HOST, 0))  # loopback only: the agent programs run in this process
        port = sock.getsockname()[1]
        self._server, self.connections = listen.server(
            self.app, self.limits, name="agent gateway", lifespan="off", access_log=False)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]},
                                        daemon=True, name="tiller-gateway")
        self._thread.start()
        deadline = time.monotonic() + self.start_timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"the agent gateway did not start on 127.0.0.1:{port} "
                                   f"within {self.start_timeout_s:g} s")
            time.sleep(0.01)
        self.base_url = f"http://127.0.0.1:{port}/v1"
        logger.info("agent gateway serving %s", self.base_url)
        return self

    def close(self) -> None:
        """Stop the server (open sessions end: their calls are answered 404)."""
        if self._server is None:
            return
        self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=30)
            if self._thread.is_alive():
                logger.error("the agent gateway did not stop within 30 s")
        self._server = None
        if self.connections is not None:
            self.connections.flush()
        if self.counts:
            logger.info("agent gateway: %s", dict(sorted(self.counts.items())))

    def stats(self) -> dict[str, float]:
        with self.lock:
            # dict() copies in one step: the server's thread counts refusals meanwhile
            counts = self.counts + Counter(dict(self.connections.counts if self.connections
                                                else {}))
            return {f"gateway/{k}": float(v) for k, v in counts.items()}

    # ------------------------------------------------------------------ sessions
    def open(self, actor: Actor, tokenizer: Any, builder: TrajectoryBuilder, *, seed: int,
             limits: EpisodeLimits) -> Session:
        """A fresh session for one episode, its turns generated by `actor` on the calling
        event loop (the episode's), rendered with `tokenizer`'s chat template and appended to
        `builder`."""
        key = f"tiller-{secrets.token_hex(16)}"
        session = Session(key, actor, tokenizer, builder, seed=seed, limits=limits,
                          loop=asyncio.get_running_loop())
        with self.lock:
            self.sessions[key] = session
            self.counts["sessions"] += 1
        return session

    def close_session(self, session: Session) -> None:
        """End the session: its key answers 404 from now on, and a call still generating is
        cancelled (its tokens never reach the trajectory, and are counted)."""
        with self.lock:
            session.ended = True
            self.sessions.pop(session.key, None)
            self.ended[session.key] = None
            while len(self.ended) > ENDED_KEYS_KEPT:
                self.ended.popitem(last=False)
            inflight = session.inflight
        if inflight is not None and inflight.cancel():
            with self.lock:
                self.counts["cancelled_at_close"] += 1

    def _session(self, request: Request) -> Session:
        given = request.headers.get("authorization", "")
        scheme, _, key = given.partition(" ")
        if scheme.lower() != "bearer" or not key:
            raise APIError(401, "missing session key: send 'Authorization: Bearer <key>' "
                                "with the api_key tiller gave this episode")
        with self.lock:
            session = self.sessions.get(key)
            if session is None and key in self.ended:
                self.counts["late_calls"] += 1
                raise APIError(404, "this session has ended (its episode is over); each "
                                    "episode gets a fresh api_key")
        if session is None:
            raise APIError(401, "unknown session key: use the api_key tiller passed to "
                                "this episode's agent program")
        return session

    # ------------------------------------------------------------------ the app
    def _build_app(self, max_body_bytes: int) -> FastAPI:
        app = FastAPI(title="tiller agent gateway", docs_url=None, redoc_url=None,
                      openapi_url=None)
        app.add_middleware(Guard, max_body_bytes=max_body_bytes, hosts=Hosts(HOST),
                           refused=lambda scope, e: self._count_rejection(
                               scope["method"], scope["path"], e))
        app.add_middleware(CatchAll)

        @app.exception_handler(APIError)
        async def api_error(request: Request, e: APIError) -> JSONResponse:
            self._count_rejection(request.method, request.url.path, e)
            return JSONResponse(e.body(), status_code=e.status)

        @app.exception_handler(StarletteHTTPException)
        async def http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
            message = (f"{request.method} {request.url.path} is not served by the agent "
                       "gateway; it serves GET /v1/models and POST /v1/chat/completions"
                       if e.status_code in (404, 405) else str(e.detail))
            error = APIError(e.status_code, message)
            self._count_rejection(request.method, request.url.path, error)
            return JSONResponse(error.body(), status_code=e.status_code)

        @app.get("/health")
        async def health() -> dict[str, Any]:
            return {"status": "ok"}

        @app.get("/v1/models")
        async def models(request: Request) -> dict[str, Any]:
            self._session(request)
            return {"object": "list", "data": [{"id": self.model, "object": "model",
                                                "created": 0, "owned_by": "tiller"}]}

        @app.post("/v1/chat/completions")
        async def chat(request: Request) -> Any:
            session = self._session(request)
            try:
                return await self._chat(session, request)
            except APIError:
                session.rejected += 1
                raise

        return app

    def _count_rejection(self, method: str, path: str, e: APIError) -> None:
        with self.lock:
            self.counts[f"rejected/{e.status}"] += 1
            first = (e.status, path) not in self._logged
            self._logged.add((e.status, path))
        # the first of each kind is a warning, the rest are counted (`stats`) and debug-logged
        logger.log(logging.WARNING if first else logging.DEBUG, "agent gateway: %s %s -> %d: %s",
                   method, path[:200], e.status, e.message)

    def _inputs(self, session: Session, raw: bytes
                ) -> tuple[ChatCompletionRequest, list[dict[str, Any]], list[dict] | None]:
        """The call's body, messages and tools (template form), checked and bounded by the
        episode's token budget before anything is rendered (in a worker thread)."""
        body = parse_chat(raw, session.limits.max_episode_tokens, "env.max_episode_tokens",
                          self.max_json_values, "the gateway's max_json_values")
        check_model_and_stop(body, self.model)
        if body.n != 1:
            raise APIError(400, f"n={body.n}: a session samples one choice per call (the "
                                "trajectory continues one of them); use n=1")
        messages, tools = chat_inputs(body)
        return body, messages, tools

    async def _chat(self, session: Session, request: Request) -> Any:
        body, messages, tools = await asyncio.to_thread(self._inputs, session,
                                                        await request.body())
        ignored = sorted(SAMPLING_FIELDS & body.model_fields_set)
        with self.lock:
            if ignored:  # the run's sampling settings hold, so the trainer's logprobs match
                self.counts["sampling_fields_ignored"] += 1
                if "sampling" not in self._logged:
                    self._logged.add("sampling")
                    logger.warning("agent gateway: the request sets %s; the run's sampling.* "
                                   "settings are used instead (counted as "
                                   "gateway/sampling_fields_ignored)", ", ".join(ignored))
            if session.busy:
                raise APIError(409, "this session has a call in flight: an episode's calls "
                                    "are sequential (one trajectory); wait for its answer")
            session.busy = True
        try:
            return await self._turn(session, body, messages, tools)
        finally:
            with self.lock:
                session.busy = False

    async def _turn(self, session: Session, body: ChatCompletionRequest,
                    messages: list[dict[str, Any]], tools: list[dict] | None) -> Any:
        limits = session.limits
        if session.calls >= limits.max_turns:
            session.refused = f"turn limit: env.max_turns={limits.max_turns} calls"
            raise APIError(400, f"this episode has made its {limits.max_turns} calls "
                                "(env.max_turns); end the episode")
        chat, plan = await asyncio.to_thread(_plan, session, messages, tools)
        room = limits.max_episode_tokens - len(plan.prompt)
        if room <= 0:
            session.refused = (f"token budget: a prompt of {len(plan.prompt)} tokens, "
                               f"env.max_episode_tokens={limits.max_episode_tokens}")
            raise APIError(400, f"the prompt has {len(plan.prompt)} tokens, the episode's "
                                f"budget is {limits.max_episode_tokens} "
                                "(env.max_episode_tokens); end the episode")
        try:
            gen = await session.generate(plan.prompt, messages)
        except asyncio.CancelledError:
            if session.ended:  # the episode closed the session while this call generated
                raise APIError(404, "this session ended while the call was generating") from None
            raise
        except RUN_FAILURES as e:  # the run's own failure: the episode re-raises it
            session.run_failure = e
            raise APIError(500, f"the run failed: {type(e).__name__}: {e}"[:300]) from e
        except Exception as e:
            session.aborted = f"engine: {type(e).__name__}: {e}"
            raise APIError(500, f"the engine failed: {type(e).__name__}: {e}"[:300]) from e
        keep = min(len(gen.token_ids), room,
                   body.max_completion_tokens or body.max_tokens or len(gen.token_ids))
        with self.lock:
            if session.ended:
                self.counts["cancelled_at_close"] += 1
                raise APIError(404, "this session ended while the call was generating")
            kept, turn = session.commit(plan, gen, keep, chat, messages, tools)
            self.counts["calls"] += 1
            if plan.kind not in ("first", "extend"):
                self.counts[f"splits/{plan.kind}"] += 1
        choice = chat_choice(session.tokenizer, turn, kept, 0, body)
        session.remember(messages, template_message(ChatMessage.model_validate(
            choice["message"])))
        if gen.finish_reason == "abort":
            session.aborted = "engine: the request was aborted mid-turn"
            raise APIError(503, "the engine aborted this turn (the run is stopping); end the "
                                "episode")
        rid = f"chatcmpl-{secrets.token_hex(12)}"
        return chat_reply(body, rid, plan.prompt, [kept], [choice])


def _plan(session: Session, messages: list[dict[str, Any]], tools: list[dict] | None
          ) -> tuple[ChatFormat, Plan]:
    """The call's chat format and prompt plan (rendering: run in a worker thread)."""
    try:
        chat = ChatFormat(session.tokenizer, tools, session.limits.chat_format)
        return chat, session.plan(chat, messages, tools)
    except TEMPLATE_ERRORS as e:
        raise render_error(e) from e
