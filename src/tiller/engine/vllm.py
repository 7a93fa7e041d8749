"""The vLLM backend: the engine protocol over vLLM OpenAI-compatible servers, managed (tiller
starts them from their own Python environment, `engine/servers.py`) or attached (`engine.urls`).

It is the HTTP backend (`http.HttpEngine`: sticky sessions, retries on another server, servers
marked down, bounded waits) speaking vLLM's API instead of SGLang's:
- generate: `POST /v1/completions` with the prompt as token ids, `return_token_ids`, `logprobs:
  0` (the sampled token's logprob), the request's `seed`, the stop token ids and
  `request_id`; the answer's `token_ids` are the trajectory's (token in, token out). The servers
  run with `--logprobs-mode processed_logprobs`: the logprob of the distribution sampled from
  (after temperature, top-k and top-p), i.e. `sampling.logprobs: sampled` (untruncated is
  refused). vLLM's default mode (raw_logprobs, before temperature) would make every run at a
  temperature other than 1 silently off-policy, so at connect each server samples one token at
  temperature 0.5 and one at 1, and the spread of its top logprobs must be twice as large at
  0.5 (`check_logprobs_mode`).
  CPU servers run with `--no-enable-chunked-prefill`: vLLM 0.32's CPU runner rewinds a seeded
  request's CPU generator when its prefill is split, and dies ("does not use offset").
- abort: `POST /abort_requests` with vLLM's id of the request (`cmpl-<id>-0`).
- pause / resume: `POST /pause?mode=keep` (requests stay queued) and `POST /resume`.
- weights: full updates only, written as safetensors (tied tensors each written out: a reload
  of the embedding alone leaves vLLM's lm_head stale), then per server `GET /weight_info` (a
  server whose version is not the one tiller set last restarted: marked down, counted in
  `servers_restarted`, and it takes this push and rejoins), `/pause`, `POST /collective_rpc`
  `reload_weights(weights_path=...)` (with `transfer` shm instead: the update in one /dev/shm
  segment, `vllm_shm`, loaded by `/start_weight_update`, `/update_weights`,
  `/finish_weight_update`), `POST /reset_prefix_cache?reset_running_requests=true`
  (else KV computed by the old weights is reused), `POST /update_weight_version` and its read-back
  from `/weight_info`; `/resume` is always sent at the end (a failed or timed-out step must not
  leave the server paused; a resume that fails marks the server down, counted in
  `resume_failures`). The steps share one time budget (`timeout_s`). An update is checked first
  against the names and shapes of the trainer's model (a tensor vLLM cannot place kills the
  server); vLLM's HTTP API exposes no tensor shapes of the served model (its own tensors are
  fused: qkv_proj, gate_up_proj), so an attached server of another model is caught by
  /v1/models (context length) and the parity check of the first sync, not by shapes.
- parity: `prompt_logprobs` of the probe at temperature 1 (`score`).
vLLM's /v1/completions reports no weight version: every token of an answer gets the version its
request started under, as the HTTP backend records a server that reports none (a turn spanning
an update counts as staler than it is, never fresher); an attached server restarted between
two pushes is noticed at the next push, and the answers it gave in between came from the
weights it restarted with. These endpoints need `VLLM_SERVER_DEV_MODE=1`.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Awaitable, Callable
from functools import partial
from pathlib import Path
from typing import Any

from safetensors.torch import save_file
from transformers import PreTrainedModel

from tiller.config import VllmEngineConfig
from tiller.engine.api import Generation, SamplingParams
from tiller.engine.delta import DeltaUpdate
from tiller.engine.http import _SKIPPED, HEALTH_TIMEOUT_S, HttpEngine, Server, ServerDown
from tiller.engine.servers import Launched, Launcher, ManagedServers, last_line
from tiller.engine.updates import WeightSyncError, WeightUpdate
from tiller.engine.vllm_launch import (
    SERVED_NAME,
    default_python,
    device_type,
    server_env,
    server_specs,
)
from tiller.engine.vllm_shm import (
    DTYPES,
    SHM_DIR,
    plugin_installed,
    remove_segment,
    remove_stale_segments,
    unfit_dtypes,
    write_segment,
)
from tiller.engine.wire import TillerDialect, short
from tiller.errors import ConfigError, RunError

logger = logging.getLogger(__name__)
FINISH = {"stop": "stop", "length": "length", "abort": "abort"}  # vLLM's reasons -> tiller's
# the logprobs-mode check at connect (`logprobs_spread_ratios`): one token sampled at MODE_T
# and at 1, the logprobs of the MODE_TOP most likely tokens of each; their spread at MODE_T
# over that at 1 must be 1/MODE_T (2; raw_logprobs, vLLM's default, gives 1) within MODE_TOL.
# Not against the trainer's logprobs: a bf16 server's are up to 2.2 from a bf16 trainer's on
# SmolLM2-135M (mean over the top 5 at T = 0.5), more than raw and processed differ by
MODE_T, MODE_TOP, MODE_TOL = 0.5, 5, 0.25
MODE_MIN_SPREAD = 1e-3  # sum of (top - logprob) at T = 1 below which the ratio means nothing
# logprobs at MODE_T = 0.5 lie -log sum(p^2) above twice those at 1 (p = softmax(z)), which the
# top logprobs at 1 bound; logits (processed_logits: z / T) lie exactly on twice: the check
# allows MODE_SHIFT_TOL around the bounds (values from the same fp32 logits agree to ~1e-5)
MODE_SHIFT_TOL = 0.05
MODE_PROMPT = [1, 2, 3, 4, 5, 6, 7, 8]
Step = Callable[[str, dict | None], Awaitable[Any]]  # one call of a push (VllmEngine._step)


class VllmDialect(TillerDialect):
    """What the router needs to know of vLLM beyond `VllmEngine`'s own requests and answers:
    its name in messages, and that it reloads full checkpoints only (the weight sync defaults
    to full)."""

    name = "vLLM"
    takes_deltas = False


VLLM = VllmDialect()


class VllmEngine(HttpEngine):
    """`Engine` over vLLM servers at `urls`; `managed` (when tiller started them) is stopped at
    `close`. `shapes`: the trainer's model's tensors by name, which the servers were started
    from (an update must match them)."""

    def __init__(self, urls: list[str], *, weights_dir: str | Path,
                 shapes: dict[str, tuple[int, ...]], transfer: str = "disk", **kwargs: Any):
        super().__init__(urls, weights_dir=weights_dir, dialect=VLLM, **kwargs)
        self.shapes = shapes
        self.transfer = transfer  # engine.weight_transfer: disk | shm
        self._segment: dict[str, Any] | None = None  # shm: the last push's segment
        self.counters.update(servers_restarted=0, resume_failures=0, stale_segments_removed=0,
                             segments_rewritten=0)
        self._versioned: set[str] = set()  # servers whose weight version tiller set
        if transfer == "shm":
            stale = remove_stale_segments()
            self.counters["stale_segments_removed"] = len(stale)
            if stale:
                logger.warning("removed %d shared-memory weight segment(s) of trainers that no "
                               "longer run from %s: %s", len(stale), SHM_DIR, ", ".join(stale))

    # ------------------------------------------------------------------ generate
    def _request(self, prompt_ids: list[int], params: SamplingParams, max_new: int, seed: int,
                 rid: str, session_id: str | None) -> tuple[str, dict[str, Any]]:
        if params.logprobs != "sampled" and (params.top_k or params.top_p < 1):
            raise RunError("vLLM (--logprobs-mode processed_logprobs) reports logprobs of the "
                           "distribution after top-k / top-p: set sampling.logprobs: sampled")
        return "/v1/completions", {
            "model": SERVED_NAME, "prompt": prompt_ids, "max_tokens": max_new,
            "temperature": params.temperature, "top_p": params.top_p,
            "top_k": params.top_k or -1,  # vLLM: -1 = off
            "seed": seed & (2**63 - 1), "stop_token_ids": list(params.stop_token_ids),
            "logprobs": 0, "return_token_ids": True, "skip_special_tokens": False,
            "request_id": rid, "ignore_eos": True,  # only the template's stop tokens end a turn
        }

    def _parse(self, server: Server, answer: Any, prompt_tokens: int, started: int,
               params: SamplingParams) -> Generation:
        try:
            choice = answer["choices"][0]
            ids = [int(t) for t in choice["token_ids"]]
            logprobs = [float(x) for x in choice["logprobs"]["token_logprobs"]]
            reason = FINISH[choice["finish_reason"]]
        except (KeyError, TypeError, ValueError, IndexError) as e:
            raise RunError(f"server {server.url}: /v1/completions answer lacks choices[0] "
                           f"token_ids, logprobs.token_logprobs or a known finish_reason: "
                           f"{type(e).__name__}: {e}") from e
        if len(logprobs) != len(ids):
            raise RunError(f"server {server.url}: {len(logprobs)} logprobs for {len(ids)} "
                           "token ids")
        version = min(started, server.version)
        usage = answer.get("usage") or {}
        details = usage.get("prompt_tokens_details") or {}
        return Generation(ids, logprobs, reason, server.version, versions=(version,) * len(ids),
                          prompt_tokens=int(usage.get("prompt_tokens", prompt_tokens)),
                          cached_tokens=int(details.get("cached_tokens") or 0))

    # ------------------------------------------------------------------ control
    def abort(self, request_id: str, *, timeout_s: float | None = None) -> bool:
        server = self._rids.get(request_id)
        if server is None:
            return False
        answer = self._call(self._post(server, "/abort_requests",
                                       {"request_ids": [f"cmpl-{request_id}-0"]},
                                       timeout=timeout_s),
                            f"abort of {request_id} on {server.url}",
                            None if timeout_s is None else timeout_s + 1.0)
        return isinstance(answer, dict) and int(answer.get("aborted", 0)) > 0

    def pause(self) -> None:
        self._fan_out("/pause?mode=keep")

    def resume(self) -> None:
        self._fan_out("/resume")

    def flush_cache(self) -> int:
        """Drop every server's prefix cache; vLLM reports no count, so 0."""
        self._fan_out("/reset_prefix_cache?reset_running_requests=true")
        return 0

    def check_servers(self, vocab_size: int, max_context: int, dtype: str | None = None) -> None:
        """Every server serves `SERVED_NAME` with a context length of at least `max_context`
        (`/v1/models`); else one RunError naming it. Turns are then bounded by the smallest.
        `vocab_size` and `dtype` (the `HttpEngine` signature) are not checked: vLLM's
        `/v1/models` reports neither; a server of another model or vocabulary fails the parity
        check of the first weight sync (`weight_sync`)."""
        served = []
        for server in self.servers:
            info = self._call(self._post(server, "/v1/models"), f"/v1/models on {server.url}")
            models = {m.get("id"): m for m in info.get("data", [])} if isinstance(info, dict) \
                else {}
            got = models.get(SERVED_NAME, {}).get("max_model_len")
            if not isinstance(got, int) or got < max_context:
                raise RunError(f"vLLM server {server.url}: /v1/models lists {short(info)}; "
                               f"expected model {SERVED_NAME!r} with max_model_len at least "
                               f"{max_context} (start it with --served-model-name "
                               f"{SERVED_NAME} --max-model-len {max_context})")
            served.append(got)
        self.max_context = min(served)

    # ------------------------------------------------------------------ weights
    def _save(self, update: WeightUpdate | DeltaUpdate, folder: Path) -> None:
        """Check `update` against the served model, then write it as one safetensors file."""
        if isinstance(update, DeltaUpdate) or update.partial:
            raise WeightSyncError(f"weight update v{update.version}: the vLLM backend takes "
                                  "full updates only; set weight_sync.mode: full")
        problems = [f"{n}: missing" for n in self.shapes if n not in update.tensors]
        problems += [f"{n}: not in the served model" for n in update.tensors
                     if n not in self.shapes]
        problems += [f"{n}: shape {tuple(t.shape)}, served {self.shapes[n]}"
                     for n, t in update.tensors.items()
                     if n in self.shapes and tuple(t.shape) != self.shapes[n]]
        # one pass, no mask: a NaN or inf makes the sum one (so does a sum past the dtype's
        # range, which no servable weights have): 4 ms on 25M fp32 values; isfinite().all(): 50 ms
        problems += [f"{n}: not finite" for n, t in update.tensors.items()
                     if t.is_floating_point() and not math.isfinite(float(t.sum()))]
        if problems:
            raise WeightSyncError(f"weight update v{update.version} does not fit the vLLM "
                                  f"servers' model (not sent): {'; '.join(problems[:8])}")
        folder.mkdir(parents=True, exist_ok=True)  # shm: empty, kept for the push's bookkeeping
        # each name its own storage: safetensors refuses shared ones, and vLLM must get lm_head
        # (tied to the embedding) as a tensor of its own; only the second name is copied (a
        # segment holds each name's bytes at its own offset already: no copy for shm)
        seen: set[int] = set()
        tensors = {}
        for n, t in update.tensors.items():
            t = t.detach().contiguous()
            tensors[n] = t.clone() if t.data_ptr() in seen and self.transfer != "shm" else t
            seen.add(t.data_ptr())
        if self.transfer == "shm":
            # a write that fails leaves `_segment` set: `update_weights` removes the file
            reuse = self._segment["path"] if self._segment else None
            try:
                self._segment = write_segment(tensors, reuse=reuse)
            except FileNotFoundError:  # removed under the run (e.g. systemd's RemoveIPC)
                if reuse is None:
                    raise
                self._segment = None
                self.counters["segments_rewritten"] += 1
                logger.warning("the last push's weight segment %s is gone; writing v%d into a "
                               "new one", reuse, update.version)
                self._segment = write_segment(tensors)
        else:
            save_file(tensors, str(folder / "model.safetensors"))

    def update_weights(self, update: WeightUpdate | DeltaUpdate, *, in_flight: str = "continue",
                       timeout_s: float | None = None) -> int:
        """`HttpEngine.update_weights`; with `transfer` shm the segment is kept for the next
        push's write after a success, and removed after an error or Ctrl-C (a server still
        reading it keeps its mapping; the next push writes a new file) and at `close`."""
        try:
            return super().update_weights(update, in_flight=in_flight, timeout_s=timeout_s)
        except BaseException:
            self._drop_segment()
            raise

    def _drop_segment(self) -> None:
        if self._segment is not None:
            remove_segment(self._segment["path"])
            self._segment = None

    def close(self) -> None:
        try:
            self._drop_segment()
        finally:
            super().close()

    async def _push(self, server: Server, *, update: WeightUpdate | DeltaUpdate, body: dict,
                    timeout_s: float | None) -> bool:
        """`server` loads the saved `update` (module docstring, "weights"), all steps within
        `timeout_s` (default `request_timeout_s`) together, and is resumed whatever happened:
        True when it holds the update, False when it was found dead (marked down, skipped)."""
        budget = self.request_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + budget  # the rejoin probe counts too: budget + resume in all
        if server.down and not await self._may_rejoin(server, update):
            return False
        step = partial(self._step, server, deadline=deadline, budget=budget)
        server.pending = update.version
        try:
            await self._check_restarted(server, step)
            try:
                await step(f"/pause?mode={'abort' if body['abort_all_requests'] else 'keep'}",
                           {})
                await self._reload(server, update, body["model_path"], step)
            finally:  # a failed or timed-out step must not leave the server paused
                resumed = await self._resume_after_push(server, update)
        except ServerDown as e:
            self._mark_down(server, f"weight update v{update.version}: {e}")
            self.counters["push_skipped_down"] += 1
            logger.warning("weight push v%d: vLLM server %s failed (%s); marked down, skipped",
                           update.version, server.url, e)
            return False
        finally:
            server.pending = None
        if not resumed:
            return False
        server.previous, server.version = server.version, update.version
        if server.down:
            server.down = False
            self.counters["servers_rejoined"] += 1
            logger.warning("weight push v%d: vLLM server %s is back and rejoins",
                           update.version, server.url)
        return True

    async def _step(self, server: Server, path: str, body: dict | None, *, deadline: float,
                    budget: float) -> Any:
        """One call of a push, waiting at most what is left of its `budget` s."""
        left = deadline - time.monotonic()
        if left <= 0:
            raise ServerDown(f"{path}: not sent, the push's {budget:g} s are spent")
        return await self._post(server, path, body, timeout=left)

    async def _check_restarted(self, server: Server, step: Step) -> None:
        """A server whose weight version is not the one tiller set last restarted (vLLM
        reports "default" after a start): marked down and counted; the push then gives it
        the weights and it rejoins."""
        if server.down or server.url not in self._versioned:
            return
        info = await step("/weight_info", None)
        got = info.get("weight_version") if isinstance(info, dict) else info
        if got != str(server.version):
            self.counters["servers_restarted"] += 1
            self._mark_down(server, f"restarted: /weight_info reports weight version {got!r}, "
                                    f"not v{server.version} set at the last push")

    async def _reload(self, server: Server, update: WeightUpdate | DeltaUpdate, path: str,
                      step: Step) -> None:
        """Reload the weights at `path`, drop the KV of the old ones, set and read back the
        version; a RunError naming the server where vLLM answers otherwise."""
        v = update.version
        if self.transfer == "shm":  # vllm_shm: the whole update in one /update_weights
            await step("/start_weight_update", {})
            await step("/update_weights", {"update_info": self._segment})
            await step("/finish_weight_update", {})
        else:
            await step("/collective_rpc", {"method": "reload_weights",
                                           "kwargs": {"weights_path": path}})
        answer = await step("/reset_prefix_cache?reset_running_requests=true", {})
        if not (isinstance(answer, dict) and answer.get("success") is True):
            raise RunError(f"weight push v{v}: server {server.url} answered /reset_prefix_cache "
                           f"with {short(answer)}: its cache may hold KV of the old weights")
        await step("/update_weight_version", {"new_version": str(v)})
        info = await step("/weight_info", None)
        got = info.get("weight_version") if isinstance(info, dict) else info
        if got != str(v):
            raise RunError(f"weight push v{v}: server {server.url} reports weight version "
                           f"{short(got)} after the push, not {v}: it does not hold the "
                           f"trainer's weights")
        self._versioned.add(server.url)

    async def _resume_after_push(self, server: Server, update: WeightUpdate | DeltaUpdate
                                 ) -> bool:
        """`/resume`, best effort within `HEALTH_TIMEOUT_S`: False (the server marked down,
        logged, counted in `resume_failures`) when it fails, since a paused server holds every
        request sent to it."""
        try:
            await self._post(server, "/resume", {}, timeout=HEALTH_TIMEOUT_S)
        except (ServerDown, RunError) as e:
            self.counters["resume_failures"] += 1
            self._mark_down(server, f"weight update v{update.version}: /resume failed: {e}")
            logger.error("weight push v%d: vLLM server %s did not resume (%s); marked down",
                         update.version, server.url, e)
            return False
        return True

    async def _score_on(self, server: Server, *, token_ids: list[int],
                        timeout_s: float | None) -> list[float] | object:
        """log p(token_i | tokens_<i) for i >= 1 at temperature 1 from `server`'s
        `prompt_logprobs` (`HttpEngine.score_servers` calls it on every up server)."""
        body = {"model": SERVED_NAME, "prompt": token_ids, "max_tokens": 1, "temperature": 1.0,
                "prompt_logprobs": 0, "seed": 0}
        answer = await self._control(server, "/v1/completions", body, timeout=timeout_s,
                                     doing="scoring the parity probe: ")
        if answer is _SKIPPED:
            return _SKIPPED
        try:
            rows = answer["choices"][0]["prompt_logprobs"]
            return [float(rows[i][str(t)]["logprob"]) for i, t in enumerate(token_ids) if i]
        except (KeyError, TypeError, IndexError, ValueError) as e:
            raise RunError(f"vLLM server {server.url}: prompt_logprobs answer "
                           f"{short(answer)}: {type(e).__name__}: {e}") from e


def time_left(deadline: float) -> float:
    """Seconds until `deadline` (`time.monotonic()`), at least 1: each step of a start-up
    gets what is left of its one deadline, and a step that comes last still gets a try."""
    return max(deadline - time.monotonic(), 1.0)


def probe(engine: VllmEngine, token_id: int, deadline: float) -> None:
    """One one-token generate on every server at once, within what is left until `deadline`
    (`time.monotonic()`; at least 1 s): vLLM answers /health before it has run the model, and
    a model its kernels refuse (e.g. a head size its CPU attention lacks) fails only then. A
    failure is one RunError naming the server and, when managed, its log."""
    left = time_left(deadline)
    body = {"model": SERVED_NAME, "prompt": [token_id], "max_tokens": 1, "seed": 0,
            "return_token_ids": True}
    logs = engine.managed.logs() if engine.managed else {}

    async def one(server: Server) -> None:
        try:
            await engine._post(server, "/v1/completions", body, timeout=left)
        except (ServerDown, RunError) as e:
            log = logs.get(server.url)
            where = f"; log {log}: {last_line(log)}" if log else ""
            raise RunError(f"vLLM server {server.url} cannot run the model (a one-token "
                           f"generate failed: {short(str(e), 150)}){where}") from e

    engine._on_each(engine.servers, one, "the start-up probe", left + 5.0)


def logprobs_spread_ratios(engine: VllmEngine, timeout_s: float) -> dict[str, float]:
    """By server URL: how much more spread its logprobs are at temperature `MODE_T` than at
    temperature 1. Each server samples one token after `MODE_PROMPT` at both temperatures with
    the logprobs of its `MODE_TOP` most likely tokens; the ratio is sum(top - lp_i) at `MODE_T`
    over the same at 1, over the tokens of both answers. Both answers come from the same logits
    z (the server's own), so it is exact whatever the precision: 1/`MODE_T` for logprobs of
    softmax(z / T) (processed_logprobs), 1 for vLLM's default raw_logprobs (softmax(z), before
    temperature). A failed generate, an answer without top logprobs, values that are no
    logprobs (their probabilities sum past 1, or, at `MODE_T` against 1, not shifted as
    logprobs are: `logprobs_shift_bounds`; vLLM's logits modes) or top tokens of equal logprobs
    (no spread to compare) are one RunError naming the server."""
    def body(temperature: float) -> dict:
        return {"model": SERVED_NAME, "prompt": MODE_PROMPT, "max_tokens": 1, "seed": 0,
                "temperature": temperature, "logprobs": MODE_TOP,
                "return_tokens_as_token_ids": True}

    ratios: dict[str, float] = {}

    async def top(server: Server, temperature: float) -> dict[int, float]:
        try:
            answer = await engine._post(server, "/v1/completions", body(temperature),
                                        timeout=timeout_s)
            got = answer["choices"][0]["logprobs"]["top_logprobs"][0]
            values = {int(k.rsplit(":", 1)[1]): float(v) for k, v in got.items()}
        except (ServerDown, KeyError, TypeError, IndexError, ValueError) as e:
            raise RunError(f"vLLM server {server.url}: the logprobs-mode check's one-token "
                           f"generate failed: {type(e).__name__}: {short(str(e), 150)}") from e
        if not values or sum(math.exp(min(v, 50.0)) for v in values.values()) > 1.0 + 1e-3:
            raise RunError(f"vLLM server {server.url}: the logprobs-mode check got "
                           f"{short(values)} at temperature {temperature:g}, which are no "
                           f"logprobs: start it with --logprobs-mode processed_logprobs")
        return values

    async def one(server: Server) -> None:
        at_t, at_1 = await top(server, MODE_T), await top(server, 1.0)
        both = at_t.keys() & at_1.keys()
        spread_t = sum(max(at_t.values()) - at_t[k] for k in both)
        spread_1 = sum(max(at_1.values()) - at_1[k] for k in both)
        if spread_1 < MODE_MIN_SPREAD:
            raise RunError(f"vLLM server {server.url}: the logprobs-mode check cannot tell the "
                           f"mode: the top {len(both)} logprobs after {MODE_PROMPT} are within "
                           f"{spread_1:.2g} of each other")
        shift = sum(at_t[k] - at_1[k] / MODE_T for k in both) / len(both)
        low, high = logprobs_shift_bounds(list(at_1.values()))
        if not low - MODE_SHIFT_TOL <= shift <= high + MODE_SHIFT_TOL:
            raise RunError(f"vLLM server {server.url}: its top values at temperature {MODE_T:g} "
                           f"lie {shift:.3g} above {1 / MODE_T:g}x those at 1, where logprobs "
                           f"lie in [{low:.3g}, {high:.3g}] (logits: 0), so they are no "
                           f"logprobs: start it with --logprobs-mode processed_logprobs")
        ratios[server.url] = spread_t / spread_1

    engine._on_each(engine.servers, one, "the logprobs-mode check", 2 * timeout_s + 5.0)
    return ratios


def logprobs_shift_bounds(top_at_1: list[float]) -> tuple[float, float]:
    """Bounds on how far logprobs at temperature `MODE_T` = 0.5 lie above twice those at 1,
    from the top logprobs at 1. With p = softmax(z): log softmax(2z) - 2 log softmax(z) =
    2 LSE(z) - LSE(2z) = -log sum(p^2), the same for every token, 0 only for one certain
    token; the top k give sum(p^2) >= sum(top p^2) and <= sum(top p^2) + (1 - sum(top p)) *
    max(p) (the rest are each at most the largest). Logits (z / T) lie on twice exactly: shift
    0, outside these bounds unless the top token is nearly certain."""
    p = [math.exp(min(v, 0.0)) for v in top_at_1]
    squares, rest = sum(x * x for x in p), max(0.0, 1.0 - sum(p))
    if squares == 0.0:  # every value -inf (or below exp's range): nothing to bound by
        return math.inf, math.inf
    return -math.log(squares + rest * max(p)), -math.log(squares)


def check_logprobs_mode(engine: VllmEngine, timeout_s: float) -> None:
    """Every server's `logprobs_spread_ratios` must be 1/`MODE_T` within `MODE_TOL`: a server of
    another --logprobs-mode (vLLM's default raw_logprobs is before temperature: 1) would make
    every run at T != 1 off-policy without an error. Else one RunError naming the server."""
    for url, ratio in logprobs_spread_ratios(engine, timeout_s).items():
        if abs(ratio - 1 / MODE_T) > MODE_TOL:
            raise RunError(f"vLLM server {url}: its logprobs at temperature {MODE_T} are "
                           f"{ratio:.3f}x as spread as at temperature 1, not {1 / MODE_T:g}x "
                           f"(vLLM's default raw_logprobs are before temperature: 1x): start it "
                           f"with --logprobs-mode processed_logprobs")


def connect_vllm(cfg: VllmEngineConfig, model: PreTrainedModel, tokenizer: Any, *,
                 run_dir: Path, initial: WeightUpdate, dtype: str,
                 context: int | None = None, launch: Launcher = ManagedServers) -> VllmEngine:
    """A `VllmEngine` on `cfg.urls`, or on `cfg.servers` servers it starts from `cfg.python` on
    the model saved to `<run_dir>/vllm-model` (logs in `<run_dir>/servers`); `launch` starts
    them (`ManagedServers`: child processes of this one). `context`: the tokens one sequence
    of the run may take (default and at most the model's context), the managed servers'
    --max-model-len (their KV cache must hold one such sequence) and the least an attached
    server must serve. Each server is probed with a one-token generate, checked against the
    model, given `initial` and its logprobs mode checked (`check_logprobs_mode`). Managed, one
    deadline `cfg.startup_timeout_s` holds vLLM's platform check (`device_type`), under shm
    the plugin check, saving the model, the servers' start and the probe: each gets what is
    left of it (the probe at least 1 s; review s10 F5). Attached, the probe gets
    `cfg.request_timeout_s`. Whatever fails closes what was started and is one error line."""
    deadline = time.monotonic() + (cfg.request_timeout_s if cfg.urls else cfg.startup_timeout_s)
    shapes = {n: tuple(t.shape) for n, t in model.state_dict().items()}
    api_key = cfg.api_key.get_secret_value() if cfg.api_key else \
        os.environ.get("TILLER_API_KEY")
    max_context = int(model.config.max_position_embeddings)
    max_context = min(max_context, context or max_context)
    managed: Launched | None = None
    urls = list(cfg.urls)
    if cfg.weight_transfer == "shm" and not SHM_DIR.is_dir():
        raise ConfigError(f"config field engine.weight_transfer: shm needs {SHM_DIR}, which "
                          "this machine lacks; use disk")
    if cfg.weight_transfer == "shm" and (unfit := unfit_dtypes(initial.tensors)):
        raise ConfigError(f"config field engine.weight_transfer: shm carries {', '.join(DTYPES)}"
                          f" tensors only, and the model has {', '.join(unfit[:4])}; use disk")
    if not urls:
        python = Path(cfg.python) if cfg.python else default_python()
        if not python.is_file():
            raise ConfigError(f"config field engine.python: {python} does not exist; build the "
                              "vLLM environment with `bash scripts/setup.sh` or point "
                              "engine.python at a Python that has vllm")
        model_dir = run_dir / "vllm-model"
        # the platform as the servers will see it: their Python and environment, within the
        # start-up time (its output in a log only when it fails)
        platform = device_type(str(python), server_env(cfg.threads, cfg.weight_transfer,
                                                       api_key),
                               timeout_s=time_left(deadline),
                               log=run_dir / "vllm-platform.log")
        specs = server_specs(str(python), model_dir, cfg.servers, max_context=max_context,
                             dtype=dtype, kv_cache_bytes=cfg.kv_cache_bytes,
                             threads=cfg.threads, extra_args=cfg.extra_args,
                             cpu=platform == "cpu", transfer=cfg.weight_transfer,
                             api_key=api_key)
        if cfg.weight_transfer == "shm" and not plugin_installed(
                str(python), specs[0].env, timeout_s=time_left(deadline)):
            raise ConfigError(f"config field engine.weight_transfer: shm needs tiller's vLLM "
                              f"plugin (entry point tiller_shm) in {python}'s environment; "
                              "install it with `bash scripts/setup.sh` or use disk")
        model.save_pretrained(model_dir)
        tokenizer.save_pretrained(model_dir)
        managed = launch(specs, log_dir=run_dir / "servers",
                         startup_timeout_s=time_left(deadline))
        urls = managed.start()
    try:
        engine = VllmEngine(urls, weights_dir=cfg.weights_dir or run_dir / "weights",
                            root=None if cfg.weights_dir else run_dir, shapes=shapes,
                            transfer=cfg.weight_transfer, managed=managed,
                            request_timeout_s=cfg.request_timeout_s,
                            max_retries=cfg.max_retries, api_key=api_key)
    except BaseException:
        if managed is not None:
            managed.close()
        raise
    try:
        probe(engine, 0, deadline)
        engine.check_servers(int(model.config.vocab_size), max_context)
        engine.update_weights(initial)
        check_logprobs_mode(engine, cfg.request_timeout_s)
    except BaseException:
        engine.close()
        raise
    return engine
