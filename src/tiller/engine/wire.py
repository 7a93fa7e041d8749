"""The wire dialects of the HTTP backend: what a request body holds and how an answer reads, per
kind of server. `TillerDialect` is `tiller serve`'s; `tiller.engine.sglang.SglangDialect` is
SGLang's. The router in `tiller.engine.http` is one for both; only these differ.

Every answer is checked alike: token in, token out (the logprobs' token ids are the output ids),
a finish reason we know, per-token weight versions, and the kind of logprob the trainer
recomputes."""

from __future__ import annotations

import json
import logging
import reprlib
from typing import Any

from tiller.engine.api import Generation, SamplingParams
from tiller.errors import ConfigError, RunError

logger = logging.getLogger(__name__)
FINISH_REASONS = ("stop", "length", "abort")
SEED_MASK = 2**63 - 1  # as the embedded engine: a seed is taken to 63 bits


class ServerDown(Exception):
    """A server that did not answer (connection error, timeout), answered 502/503/504, or
    answered from weights other than those pushed to it (it restarted)."""


# a repr cut while it is built (a few items per level, short strings): an answer of megabytes is
# never stringified whole to be cut to one line
_BRIEF = reprlib.Repr()
_BRIEF.maxlevel, _BRIEF.maxdict, _BRIEF.maxlist, _BRIEF.maxtuple = 4, 6, 6, 6
_BRIEF.maxstring, _BRIEF.maxother, _BRIEF.maxlong = 120, 120, 40


def short(text: Any, n: int = 200) -> str:
    """`text` on one line (whitespace runs made one space, other unprintable characters
    escaped: a server's text never drives the terminal), cut to `n` characters; a value
    other than a string is shown by a repr cut as it is built (`_BRIEF`)."""
    text = text[:4 * n] if isinstance(text, str) else _BRIEF.repr(text)
    text = "".join(c if c.isprintable() else ascii(c)[1:-1] for c in " ".join(text.split()))
    return text if len(text) <= n else text[:n] + "..."


def error_text(text: str, n: int = 600) -> str:
    """An error answer's body for a one-line error: the message of an OpenAI-style
    `{"error": {"message"}}`, `{"message"}` or FastAPI's `{"detail"}` body (the JSON wrapping
    would spend the line), else the text; `short`, with room for a server's own message after
    the file paths it names."""
    try:
        body = json.loads(text)
    except (ValueError, RecursionError):  # not JSON, or nested past the parser's depth
        return short(text, n)
    inner = body.get("error", body) if isinstance(body, dict) else None
    if isinstance(inner, dict):
        for key in ("message", "detail"):
            if isinstance(inner.get(key), str) and inner[key].strip():
                return short(inner[key], n)
    return short(text, n)


def check_logprob_kind(url: str, answer: Any, params: SamplingParams) -> None:
    """With top-k / top-p on, the logprobs must be the kind the trainer recomputes
    (`params.logprobs`, from sampling.logprobs): tiller serve reports `meta_info.logprob_kind`
    ("sampled"); a server that does not say is taken to report untruncated logprobs."""
    if params.top_k == 0 and params.top_p >= 1:
        return  # no truncation: both kinds are the same number
    kind = answer["meta_info"].get("logprob_kind", "untruncated")
    if kind != params.logprobs:
        raise RunError(f"server {url} reports {kind} logprobs (meta_info.logprob_kind) under "
                       f"top_k {params.top_k} / top_p {params.top_p}, but sampling.logprobs is "
                       f"{params.logprobs}: set sampling.logprobs: {kind} so the trainer "
                       "recomputes the same kind")


def parse_generation(url: str, answer: Any, prompt_tokens: int, started: int,
                     dialect: TillerDialect | None = None) -> Generation:
    """A `Generation` from a /generate answer in `dialect` (default tiller serve's), checked:
    the logprobs' token ids must be the output ids (token in, token out) and the finish reason
    one we know."""
    dialect = dialect or TILLER
    try:
        ids = [int(t) for t in answer["output_ids"]]
        meta = answer["meta_info"]
        pairs = meta["output_token_logprobs"]
        reason = meta["finish_reason"]["type"]
        raw = meta["weight_version"]
    except (KeyError, TypeError, ValueError) as e:
        raise RunError(f"server {url}: /generate answer lacks output_ids or meta_info "
                       f"(output_token_logprobs, finish_reason.type, weight_version)"
                       f": {type(e).__name__}: {e}; ask with return_logprob") from e
    version = dialect.answer_version(url, raw)
    logged = [int(p[1]) for p in pairs]
    if logged != ids:
        at = next((i for i, (a, b) in enumerate(zip(logged, ids, strict=False)) if a != b),
                  min(len(logged), len(ids)))
        raise RunError(f"server {url}: output_token_logprobs' token ids differ from output_ids "
                       f"at position {at} ({len(logged)} vs {len(ids)} tokens): the server does "
                       f"not return the tokens it sampled")
    if reason not in FINISH_REASONS:
        raise RunError(f"server {url}: finish_reason {reason!r}; expected one of "
                       f"{', '.join(FINISH_REASONS)}")
    # per-token versions when the server reports them (tiller serve does); else every token
    # gets the version the request started under: a turn spanning an update then counts as
    # staler than it is, never fresher
    versions = tuple(dialect.token_versions(url, meta, len(ids)) or
                     [min(started, version)] * len(ids))
    if len(versions) != len(ids):
        raise RunError(f"server {url}: {len(versions)} output_token_weight_versions for "
                       f"{len(ids)} output ids")
    return Generation(ids, [float(p[0]) for p in pairs], reason, version, versions=versions,
                      prompt_tokens=int(meta.get("prompt_tokens", prompt_tokens)),
                      cached_tokens=int(meta.get("cached_tokens", 0)))


class TillerDialect:
    """`tiller serve`'s dialect: integer weight versions echoed by the push, per-token versions
    and a boot id in every answer, deltas pushed from disk, and a `/score` route."""

    name = "tiller serve"
    takes_deltas = True
    model_info_path = "/get_model_info"
    reads_back_version = False  # the push answer echoes the version it loaded

    def generate_body(self, prompt_ids: list[int], params: SamplingParams, max_new: int,
                      seed: int, rid: str, session_id: str | None) -> dict[str, Any]:
        return {"input_ids": prompt_ids,
                "sampling_params": {**self.sampling(params, max_new), "seed": seed & SEED_MASK},
                "return_logprob": True, "rid": rid, "session_id": session_id}

    def sampling(self, params: SamplingParams, max_new: int) -> dict[str, Any]:
        """The sampling fields both dialects spell alike."""
        return {"temperature": params.temperature, "top_p": params.top_p,
                "top_k": params.top_k, "max_new_tokens": max_new,
                "stop_token_ids": list(params.stop_token_ids)}

    def answer_version(self, url: str, raw: Any) -> int:
        try:
            return int(raw)
        except (TypeError, ValueError) as e:
            raise RunError(f"server {url}: weight_version {raw!r} is not an integer") from e

    def token_versions(self, url: str, meta: dict[str, Any], n: int) -> list[int] | None:
        got = meta.get("output_token_weight_versions")
        return None if not got else [int(v) for v in got]

    def push_body(self, folder: str, version: int, abort: bool) -> dict[str, Any]:
        return {"model_path": folder, "weight_version": version, "abort_all_requests": abort}

    def pushed_version(self, echoed: Any) -> int | None:
        """The version a push answer (or its read-back) says the server holds; None: none."""
        return echoed if isinstance(echoed, int) and not isinstance(echoed, bool) else None

    def pause_body(self) -> dict[str, Any]:
        return {}

    def score_request(self, token_ids: list[int]) -> tuple[str, dict[str, Any]]:
        return "/score", {"input_ids": token_ids}

    def parse_score(self, url: str, answer: Any, token_ids: list[int]) -> tuple[list[float], Any]:
        """The logprobs of tokens 1.. and the weight version they were computed under."""
        if (not isinstance(answer, dict) or not isinstance(answer.get("logprobs"), list)
                or len(answer["logprobs"]) != len(token_ids) - 1):
            raise RunError(f"server {url}: /score answered {short(answer)}; expected "
                           f"{len(token_ids) - 1} logprobs")
        return [float(x) for x in answer["logprobs"]], answer.get("weight_version")


TILLER = TillerDialect()


def check_model_info(info: Any, url: str, dialect: TillerDialect, *, vocab_size: int,
                     max_context: int, dtype: str | None) -> None:
    """A server's model info (`dialect.model_info_path`) against the trainer's model: its
    vocabulary size, context length and (when given) dtype, where the server reports them
    (a field it does not report is logged, not checked); otherwise one ConfigError naming the
    server and what to change."""
    path = dialect.model_info_path
    if not isinstance(info, dict):
        raise ConfigError(f"config field engine.urls: server {url} answered {path} with "
                          f"{short(info)}, not a JSON object")
    if dtype is not None and "dtype" in info and info["dtype"] != dtype:
        raise ConfigError(f"config field model.dtype: {dtype}, but server {url} serves dtype "
                          f"{info['dtype']}: set model.dtype: {info['dtype']} or restart it "
                          f"with --dtype {dtype}")
    for name, ours in (("vocab_size", vocab_size), ("max_context", max_context)):
        if name not in info:
            logger.warning("server %s: %s has no %s; not checked against the trainer's %s",
                           url, path, name, ours)
        elif info[name] != ours:
            raise ConfigError(f"config field engine.urls: server {url} serves a model with "
                              f"{name}={info[name]}, the trainer's has {ours}: serve the run's "
                              f"model (model.path)")
