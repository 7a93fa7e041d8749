"""What every engine backend offers, in-process or over HTTP: the `Engine` protocol, the
`SamplingParams` of a request and the `Generation` it answers with. The errors of a weight
update (`WeightSyncError`, `WeightsInconsistent`) live with the update, in `updates`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol

from tiller.engine.delta import DeltaUpdate
from tiller.engine.updates import WeightUpdate

InFlight = Literal["continue", "abort"]


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 64
    stop_token_ids: tuple[int, ...] = ()  # required: see __post_init__
    # the logprob reported per token: of the distribution sampled from (renormalised over the
    # top-k / top-p kept set), or of softmax(logits / T) before truncation (engine.sampling)
    logprobs: Literal["sampled", "untruncated"] = "sampled"

    def __post_init__(self) -> None:
        # Without a stop token every turn runs to max_new_tokens and the episode is truncated:
        # a forgotten argument would look like a policy that never stops talking.
        if not self.stop_token_ids:
            raise ValueError("SamplingParams.stop_token_ids is empty, so no turn could end: pass "
                             "tiller.rollout.chat.stop_token_ids(tokenizer, "
                             "model.generation_config)")
        def whole(x: object) -> bool:
            return isinstance(x, int) and not isinstance(x, bool)

        bad = [f"{name}={value!r} (expected {rule})" for name, value, ok, rule in (
            ("temperature", self.temperature, self.temperature >= 0, ">= 0"),
            ("top_p", self.top_p, 0 < self.top_p <= 1, "in (0, 1]"),
            ("top_k", self.top_k, whole(self.top_k) and self.top_k >= 0, "an int >= 0, 0 = off"),
            ("max_new_tokens", self.max_new_tokens,
             whole(self.max_new_tokens) and self.max_new_tokens >= 1, "an int >= 1"),
            ("stop_token_ids", self.stop_token_ids,
             all(whole(t) for t in self.stop_token_ids), "ints"),
            ("logprobs", self.logprobs, self.logprobs in ("sampled", "untruncated"),
             "'sampled' or 'untruncated'"),
        ) if not ok]
        if bad:
            raise ValueError("SamplingParams: " + "; ".join(bad))


@dataclass(frozen=True)
class Generation:
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" (a stop token was sampled), "length" or "abort"
    version: int  # the weight version when the request finished
    # per token, the version whose weights computed its logits and all the KV it attended to
    versions: tuple[int, ...] = ()
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose KV was reused instead of prefilled


class Engine(Protocol):
    """What the agent loop and the trainer need from an engine, in-process or over HTTP."""

    version: int

    async def generate(self, prompt_ids: list[int], params: SamplingParams, seed: int, *,
                       session_id: str | None = None, request_id: str | None = None
                       ) -> Generation: ...

    def abort(self, request_id: str, *, timeout_s: float | None = None) -> bool: ...

    def update_weights(self, update: WeightUpdate | DeltaUpdate, *,
                       in_flight: InFlight = "continue", timeout_s: float | None = None
                       ) -> int: ...

    def score(self, token_ids: list[int], *, timeout_s: float | None = None) -> list[float]:
        """log p(token_i | tokens_<i) at temperature 1 for i >= 1, under the engine's own
        weights (the parity check)."""
        ...

    def pause(self) -> None: ...

    def resume(self) -> None: ...

    def flush_cache(self) -> int: ...

    def stats(self) -> dict[str, float]: ...

    def close(self) -> None: ...
