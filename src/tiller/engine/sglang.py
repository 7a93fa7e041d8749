"""SGLang's wire dialect (`engine.backend: sglang`), as SGLang 0.5.23's own request classes
accept it (tests/test_sglang_contract.py runs them on every body built here):

- the per-request seed is `sampling_params.sampling_seed` (a `seed` key is refused: 400), and
  SGLang samples with it only when the server runs with `--enable-deterministic-inference`;
- top-k "off" is -1 (0 is refused by `SamplingParams.verify`);
- weight versions are strings: a push sends `weight_version: "<n>"` with
  `/update_weights_from_disk`, whose answer is `{success, message, num_paused_requests}`, so
  the version is read back from `GET /model_info`. A version that is not an integer string
  ("default", what a server reports before any push) comes from a server that restarted;
- per-token versions come from `meta_info.weight_versions` (spans `{version, start, end}`),
  present when an update landed during the request;
- no deltas (SGLang loads checkpoints from disk only), no `/score`: the parity probe is a
  `/generate` with `return_logprob`, `logprob_start_len: 0` and `max_new_tokens: 0`, whose
  `meta_info.input_token_logprobs` are `[logprob, token_id, text]` with no logprob for the
  first token;
- pause is `/pause_generation` with `mode: retract`: running requests go back to the queue,
  their KV freed, and are prefilled again at `/continue_generation`. With `in_place` (KV kept)
  a push while paused with requests running failed: its cache flush refuses a non-empty
  running batch ("Weights were updated, but the cache was not flushed"), after the weights and
  the version changed. Unpaused, a push waits (SGLang's weight-update writer lock) for every
  running request to finish, within `weight_sync.timeout_s`. This pause/push interplay is read
  from SGLang's source (scheduler.py, weight_updater.py, tokenizer_manager.py), not tested:
  the contract tests check the bodies' fields only;
- logprobs are of softmax(logits / T) before top-k / top-p (untruncated).
"""

from __future__ import annotations

from typing import Any

from tiller.engine.api import SamplingParams
from tiller.engine.wire import SEED_MASK, ServerDown, TillerDialect, short
from tiller.errors import RunError

TOP_K_OFF = -1  # SGLang's "whole vocabulary"


class SglangDialect(TillerDialect):
    """What differs from `tiller serve` (see the module docstring)."""

    name = "SGLang"
    takes_deltas = False
    model_info_path = "/model_info"
    reads_back_version = True  # the push answer carries no version

    def generate_body(self, prompt_ids: list[int], params: SamplingParams, max_new: int,
                      seed: int, rid: str, session_id: str | None) -> dict[str, Any]:
        sampling = self.sampling(params, max_new)
        sampling["top_k"] = params.top_k or TOP_K_OFF
        sampling["sampling_seed"] = seed & SEED_MASK
        return {"input_ids": prompt_ids, "sampling_params": sampling, "return_logprob": True,
                "rid": rid, "session_id": session_id}

    def answer_version(self, url: str, raw: Any) -> int:
        version = self.pushed_version(raw)
        if version is None:
            raise ServerDown(f"restarted: answered with weight version {raw!r}, not one tiller "
                             f"pushed; down until the next weight push")
        return version

    def token_versions(self, url: str, meta: dict[str, Any], n: int) -> list[int] | None:
        spans = meta.get("weight_versions")
        if not spans:
            return None
        versions: list[int] = []
        for span in spans:  # contiguous, in order: [start, end) of the output tokens
            if span["start"] != len(versions):
                raise RunError(f"server {url}: meta_info.weight_versions {short(spans)} "
                               f"do not tile the {n} output tokens")
            versions += [self.answer_version(url, span["version"])] * (span["end"] -
                                                                        span["start"])
        return versions

    def push_body(self, folder: str, version: int, abort: bool) -> dict[str, Any]:
        return {"model_path": folder, "weight_version": str(version),
                "abort_all_requests": abort}

    def pushed_version(self, echoed: Any) -> int | None:
        if isinstance(echoed, str) and echoed.isdigit():
            return int(echoed)
        return None

    def pause_body(self) -> dict[str, Any]:
        return {"mode": "retract"}

    def score_request(self, token_ids: list[int]) -> tuple[str, dict[str, Any]]:
        return "/generate", {"input_ids": token_ids, "return_logprob": True,
                             "logprob_start_len": 0,
                             "sampling_params": {"max_new_tokens": 0, "temperature": 1.0}}

    def parse_score(self, url: str, answer: Any, token_ids: list[int]) -> tuple[list[float], Any]:
        try:
            meta = answer["meta_info"]
            entries = meta["input_token_logprobs"]
            ids = [int(e[1]) for e in entries]
            logprobs = [float(e[0]) for e in entries[1:]]
        except (KeyError, TypeError, ValueError, IndexError) as e:
            raise RunError(f"server {url}: the parity probe's /generate answered "
                           f"{short(answer)}; expected meta_info.input_token_logprobs "
                           f"({type(e).__name__}: {e})") from e
        if ids != list(token_ids):
            raise RunError(f"server {url}: the parity probe's input_token_logprobs are of "
                           f"other tokens than the {len(token_ids)} sent")
        return logprobs, self.pushed_version(meta.get("weight_version"))
