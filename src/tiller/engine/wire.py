"""The answers of SGLang's `/generate` contract, which `tiller serve` speaks too, as the HTTP
backend checks them: token in, token out (the logprobs' token ids are the output ids), a finish
reason we know, per-token weight versions, and the kind of logprob the trainer recomputes."""

from __future__ import annotations

from typing import Any

from tiller.engine.api import Generation, SamplingParams
from tiller.errors import RunError

FINISH_REASONS = ("stop", "length", "abort")


def short(text: str, n: int = 200) -> str:
    """`text` on one line (whitespace runs made one space), cut to `n` characters."""
    text = " ".join(text.split())
    return text if len(text) <= n else text[:n] + "..."


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


def parse_generation(url: str, answer: Any, prompt_tokens: int, started: int) -> Generation:
    """A `Generation` from a /generate answer, checked: the logprobs' token ids must be the
    output ids (token in, token out) and the finish reason one we know."""
    try:
        ids = [int(t) for t in answer["output_ids"]]
        meta = answer["meta_info"]
        pairs = meta["output_token_logprobs"]
        reason = meta["finish_reason"]["type"]
        version = int(meta["weight_version"])
    except (KeyError, TypeError, ValueError) as e:
        raise RunError(f"server {url}: /generate answer lacks output_ids or meta_info "
                       f"(output_token_logprobs, finish_reason.type, an integer weight_version)"
                       f": {type(e).__name__}: {e}; ask with return_logprob") from e
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
    versions = tuple(int(v) for v in meta.get("output_token_weight_versions") or
                     [min(started, version)] * len(ids))
    if len(versions) != len(ids):
        raise RunError(f"server {url}: {len(versions)} output_token_weight_versions for "
                       f"{len(ids)} output ids")
    return Generation(ids, [float(p[0]) for p in pairs], reason, version, versions=versions,
                      prompt_tokens=int(meta.get("prompt_tokens", prompt_tokens)),
                      cached_tokens=int(meta.get("cached_tokens", 0)))
