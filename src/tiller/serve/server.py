"""The state `tiller serve`'s routes share: the engine, the tokenizer, the settings, the
requests in flight, and the checks every request passes before it reaches the engine (prompt ids
in the vocabulary, prompt plus new tokens within the context, `n` within `--max-n`), so the
engine only sees work it can do; anything it still raises is logged and answered 500."""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tiller.engine.api import Generation, SamplingParams
from tiller.serve.guard import Hosts, check_exposure
from tiller.serve.listen import ConnectionLimits
from tiller.serve.protocol import APIError

logger = logging.getLogger(__name__)

ABORT_GRACE_S = 5.0  # an aborted request answers at the engine's next step
CHARS_PER_TOKEN = 32  # text longer than this many characters per allowed token is refused
# JSON values a chat request may hold (--max-json-values; the gateway's bound): fixed, not the
# context, since pydantic validates every one holding the GIL (131,072 took 0.2-0.35 s)
MAX_JSON_VALUES = 32768 + 64


@dataclass(frozen=True)
class ServeSettings:
    """What `tiller serve`'s options say, as the routes use it."""

    model_path: str
    stop_token_ids: tuple[int, ...]  # the model's default: chat.stop_token_ids(...)
    dtype: str = "float32"
    device: str = "cpu"
    # one per client: each key's requests reuse only KV that requests with the same key left
    api_keys: tuple[str, ...] = ()
    hosts: Hosts = Hosts()  # the Host headers answered (the bound address, --allowed-host)
    weights_root: Path | None = None  # resolved; None: /update_weights_from_disk answers 403
    max_body_bytes: int = 4 << 20
    max_n: int = 8
    max_prompt_tokens: int | None = None  # None: the model's context
    max_json_values: int = MAX_JSON_VALUES  # a chat request's JSON values (400 above)
    request_timeout_s: float = 600.0
    # read timeout, keep-alive, connection cap; keep-alive well above HttpEngine's 2 s idle
    # expiry: a server that closes a pooled connection first fails the client's next request
    connections: ConnectionLimits = ConnectionLimits(keep_alive_s=75)

    def __post_init__(self) -> None:
        check_exposure(self.hosts.bound, self.api_keys)


class Server:
    """The engine, the tokenizer and the settings, with the checks every route shares."""

    def __init__(self, engine: Any, tokenizer: Any, settings: ServeSettings):
        self.engine, self.tokenizer, self.settings = engine, tokenizer, settings
        self.max_context: int = engine.max_context
        self.max_prompt_tokens = min(settings.max_prompt_tokens or self.max_context,
                                     self.max_context - 1)
        self.vocab_size: int = engine.model.get_input_embeddings().num_embeddings
        self.created = int(time.time())
        self.inflight: dict[str, list[str]] = {}  # rid -> the engine request ids of its choices
        self.update_lock = asyncio.Lock()  # one weight update at a time
        # new at every start: a client that sees it change knows the server restarted (with the
        # weights of MODEL_PATH, whatever version it reports)
        self.boot_id = secrets.token_hex(8)

    def check_text(self, chars: int) -> None:
        """APIError 400 for text so long it cannot fit --max-prompt-tokens, before tokenizing
        it."""
        check_chars(chars, self.max_prompt_tokens, "--max-prompt-tokens")

    def check_prompt(self, ids: list[int], max_new_tokens: int) -> None:
        """APIError 400 unless the prompt is non-empty, in the vocabulary, at most
        --max-prompt-tokens long, and leaves room for max_new_tokens in the context."""
        if not ids:
            raise APIError(400, "the prompt is empty")
        bad = next((i for i in ids if not 0 <= i < self.vocab_size), None)
        if bad is not None:
            raise APIError(400, f"token id {bad} is outside the vocabulary [0, {self.vocab_size})")
        if len(ids) > self.max_prompt_tokens:
            raise APIError(400, f"the prompt has {len(ids)} tokens, over the limit of "
                                f"{self.max_prompt_tokens} (--max-prompt-tokens / the context)")
        if len(ids) + max_new_tokens > self.max_context:
            raise APIError(400, f"the prompt has {len(ids)} tokens and {max_new_tokens} new "
                                f"tokens were asked for: together over the model's context of "
                                f"{self.max_context} tokens; shorten one of them")

    def sampling(self, *, temperature: float, top_p: float, top_k: int, max_new_tokens: int,
                 stop_token_ids: list[int] | None = None) -> SamplingParams:
        stops = tuple(self.settings.stop_token_ids if stop_token_ids is None else stop_token_ids)
        if not stops:
            raise APIError(400, "stop_token_ids is empty, so generation could not stop; omit it "
                                "for the model's stop tokens")
        bad = next((i for i in stops if not 0 <= i < self.vocab_size), None)
        if bad is not None:
            raise APIError(400, f"stop token id {bad} is outside the vocabulary")
        return SamplingParams(temperature=temperature, top_p=top_p, top_k=max(top_k, 0),
                              max_new_tokens=max_new_tokens, stop_token_ids=stops)

    def check_n(self, n: int) -> None:
        if n > self.settings.max_n:
            raise APIError(400, f"n={n} is over the limit of {self.settings.max_n} (--max-n)")

    async def generate(self, prompt: list[int], params: SamplingParams, seeds: list[int], *,
                       rid: str, client: int | None, session_id: str | None = None
                       ) -> list[Generation]:
        """One generation per seed (the choices of one request), registered under `rid` for
        /abort_request, reusing only KV of requests made with the same api key (`client`,
        the key's index; None without keys). 504 after --request-timeout-s (the requests are
        aborted), 500 if the engine raised."""
        if rid in self.inflight:
            raise APIError(400, f"rid {rid!r} is already in flight; use a new one")
        ids = [rid] if len(seeds) == 1 else [f"{rid}-{i}" for i in range(len(seeds))]
        self.inflight[rid] = ids
        scope = None if client is None else f"key{client}"
        calls = [self.engine.generate(prompt, params, seed, session_id=session_id,
                                      request_id=request_id, cache_scope=scope)
                 for seed, request_id in zip(seeds, ids, strict=True)]
        timeout = self.settings.request_timeout_s
        work = asyncio.ensure_future(asyncio.gather(*calls, return_exceptions=True))
        try:
            done, _ = await asyncio.wait({work}, timeout=timeout)
            if not done:  # abort in the engine, so no choice keeps decoding unseen
                for request_id in ids:
                    await asyncio.to_thread(self.engine.abort, request_id)
                done, _ = await asyncio.wait({work}, timeout=ABORT_GRACE_S)
                if not done:
                    logger.error("request %s: the engine did not answer its abort within "
                                 "%g s", rid, ABORT_GRACE_S)
                    work.add_done_callback(_retrieve)  # nobody awaits it any more
                    work.cancel()
                raise APIError(504, f"generation did not finish within {timeout:g} s "
                                    "(--request-timeout-s); is generation paused? "
                                    "POST /continue_generation resumes it")
            results = work.result()
        finally:
            del self.inflight[rid]
        for r in results:
            if isinstance(r, BaseException):
                logger.error("the engine failed on request %s", rid, exc_info=r)
                raise APIError(500, f"the engine failed: {type(r).__name__}: {r}"[:300])
        return results

    def completion_text(self, ids: list[int], params: SamplingParams) -> str:
        """The generated text, special tokens kept (tool-call tags are special tokens), without
        the stop token that ended it."""
        if ids and ids[-1] in params.stop_token_ids:
            ids = ids[:-1]
        return self.tokenizer.decode(ids, skip_special_tokens=False)


def client_of(request: Any) -> int | None:
    """The index of the api key the request came with (set by `Guard`); None without keys."""
    return request.scope.get("state", {}).get("client")


def check_chars(chars: int, max_tokens: int, limit: str) -> None:
    """APIError 400 for a prompt of `chars` characters, over CHARS_PER_TOKEN per token of
    `max_tokens` (named `limit` in the message): refused before it is rendered or tokenized."""
    most = CHARS_PER_TOKEN * max_tokens
    if chars > most:
        raise APIError(400, f"the prompt has {chars} characters, over the limit of {most} "
                            f"({CHARS_PER_TOKEN} per token of {limit})")


def _retrieve(future: asyncio.Future) -> None:
    """Mark a dropped future's outcome as seen, so asyncio does not log it as lost."""
    if not future.cancelled():
        future.exception()


def draw_seed(seed: int | None) -> int:
    """The request's seed, or a fresh one (reported back, so the request can be replayed)."""
    return secrets.randbelow(2**62) if seed is None else seed


def choice_seeds(seed: int, n: int) -> list[int]:
    """Choice i of a request samples with seed + i: different choices, each reproducible."""
    return [(seed + i) % 2**63 for i in range(n)]


def finish_reason(g: Generation) -> dict[str, Any]:
    """SGLang's meta_info.finish_reason."""
    if g.finish_reason == "stop":
        return {"type": "stop", "matched": g.token_ids[-1]}
    if g.finish_reason == "length":
        return {"type": "length", "length": len(g.token_ids)}
    return {"type": g.finish_reason, "message": "the request was aborted"}
