"""The trainer's side of a weight sync: build the update (full or delta), push it, check that the
engine echoes its version, then check parity.

- Full, embedded engine: the update holds references to the trainer's live tensors (no clone);
  `update_weights` blocks until the engine applied it, and the trainer does not step meanwhile,
  so the engine's one `copy_` (casting to its dtype) is the only pass over the weights.
- Delta: the sender keeps the last synced copy in the engine's dtype and ships, per tensor, the
  elements whose bit pattern changed (`tiller.engine.delta`). Diffing against what the engine
  holds, never against the previous trainer weights, means rounding never accumulates: after N
  deltas the engine equals a full sync bit for bit.
- auto: per sync, the one with fewer bytes (exact counts); a full sync whenever the engine may
  not hold the base (the first sync, a failed one, an HTTP server that was down).
- Every update carries checksums (`updates.checksums`) that the receiver verifies.
- Parity: engine and trainer score a fixed, seeded probe sequence; a mean |logprob difference|
  above `parity_tol` is a `WeightSyncError` naming the version and the server.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Protocol

import numpy as np
import torch
from torch import nn

from tiller.config import WeightSyncConfig
from tiller.engine.delta import DeltaUpdate, TensorDelta, bits, encode_gaps
from tiller.engine.parts import PartsUpdate
from tiller.engine.updates import WeightSyncError, WeightUpdate, checksums
from tiller.errors import ConfigError, RunError
from tiller.files import remove_tree

logger = logging.getLogger(__name__)

PROBE_SEED = 1234  # the probe sequence is the same in every run


class Publisher(Protocol):
    """What the weights come from (the trainer): its live model, the version its weights are
    at, and its logprobs of the parity probe under those weights."""

    model: nn.Module
    version: int

    def score(self, token_ids: list[int]) -> list[float]: ...


class WeightSync:
    """Pushes the weights of `trainer` (any `Publisher`) to `engine` (embedded or HTTP) as
    configured by `cfg`; `engine_dtype` is the dtype the engine holds its weights in."""

    def __init__(self, trainer: Publisher, engine: Any, cfg: WeightSyncConfig,
                 engine_dtype: torch.dtype):
        self.trainer, self.engine, self.cfg, self.dtype = trainer, engine, cfg, engine_dtype
        # the update leaves this process (a file an HTTP server loads; Ray's object store, to
        # the rollout workers): cast to the engine dtype first, so what crosses is what
        # sync/bytes counts
        self.ships = hasattr(engine, "servers") or getattr(engine, "ships_updates", False)
        # auto where deltas can go (tiller serve); full for the embedded engine, vLLM and SGLang
        self.mode = cfg.mode or ("auto" if getattr(engine, "takes_deltas", False) else "full")
        config = trainer.model.config
        context = getattr(config, "max_position_embeddings", cfg.parity_tokens)
        if cfg.parity_tokens > context:
            raise ConfigError(f"config field weight_sync.parity_tokens: got {cfg.parity_tokens}; "
                              f"expected at most the model's context of {context} tokens")
        gen = torch.Generator().manual_seed(PROBE_SEED)
        self.probe = torch.randint(0, config.vocab_size, (cfg.parity_tokens,),
                                   generator=gen).tolist()
        # the trainer's tensors by name, detached: the optimizer updates them in place, so
        # these references stay valid (saves a state_dict() walk per sync)
        self.own = {k: t.detach() for k, t in trainer.model.state_dict().items()}
        # one name per storage (tied embeddings are one tensor); `aliases` maps every name to it
        self.aliases: dict[str, str] = {}
        first: dict[int, str] = {}
        for name, t in self.own.items():
            self.aliases[name] = first.setdefault(t.data_ptr(), name)
        # what the engine holds, floating tensors in its dtype: the bytes of a full sync
        self.full_bytes = sum(t.numel() * self._engine_form(t).element_size()
                              for t in self._live().values())
        self.synced: dict[str, torch.Tensor] | None = None  # delta/auto: what the engine holds
        self.base: int | None = None  # the version `synced` is

    def _engine_form(self, t: torch.Tensor, copy: bool = False) -> torch.Tensor:
        """`t` as the engine holds it: floating tensors in the engine dtype, others (integer
        or bool buffers) as they are."""
        if t.is_floating_point():
            return t.to(self.dtype, copy=copy)
        return t.clone() if copy else t

    def _live(self) -> dict[str, torch.Tensor]:
        return {name: self.own[name] for name in dict.fromkeys(self.aliases.values())}

    def _engine_may_lack_base(self) -> bool:
        """True when a delta could not apply: no synced copy, the engine is at another version,
        or an HTTP server is down (it missed pushes and rejoins only through a full one)."""
        down = any(s.down for s in getattr(self.engine, "servers", ()))
        return self.synced is None or self.base != self.engine.version or down

    @torch.no_grad()
    def build(self, version: int) -> tuple[WeightUpdate | DeltaUpdate, dict[str, float]]:
        """The update for `version` and its metrics (bytes, full bytes, kind, changed fraction);
        in delta/auto mode the synced copy already holds `version` afterwards."""
        full_bytes = self.full_bytes
        if self.mode == "full":
            sums = checksums({k: self.own[k] for k in dict.fromkeys(self.aliases.values())},
                             self.dtype)
            # embedded in this process: the live tensors by reference, no copy here; shipped
            # (HTTP, Ray): in the engine's dtype, so what crosses is what sync/bytes counts
            if self.ships:  # cast once per storage: tied names stay one tensor
                cast = {k: self._engine_form(self.own[k]) for k in set(self.aliases.values())}
                own = {name: cast[first] for name, first in self.aliases.items()}
            else:
                own = dict(self.own)
            update = WeightUpdate(version, own, checksums=sums)
            return update, {"sync/bytes": full_bytes, "sync/full_bytes": full_bytes,
                            "sync/kind": 0.0, "sync/changed_frac": 1.0}
        live = self._live()
        if self._engine_may_lack_base():
            self.synced = {k: self._engine_form(t, copy=True) for k, t in live.items()}
            return self._full_from_synced(version), {
                "sync/bytes": full_bytes, "sync/full_bytes": full_bytes, "sync/kind": 0.0,
                "sync/changed_frac": 1.0}
        deltas: dict[str, TensorDelta] = {}
        changed = 0
        for name, t in live.items():
            new = self._engine_form(t)
            old = self.synced[name]
            idx = torch.nonzero(bits(new).reshape(-1) != bits(old).reshape(-1))[:, 0]
            values = new.reshape(-1)[idx]
            old.reshape(-1)[idx] = values  # the synced copy is now `version`
            gaps = encode_gaps(idx.cpu().numpy())
            deltas[name] = TensorDelta(t.numel(), torch.from_numpy(gaps), values)
            changed += idx.numel()
        delta = DeltaUpdate(version, self.base, deltas, checksums(self.synced))
        numel = sum(t.numel() for t in live.values())
        metrics = {"sync/full_bytes": full_bytes, "sync/changed_frac": changed / max(numel, 1)}
        if self.mode == "delta" or delta.nbytes < full_bytes:
            return delta, {**metrics, "sync/bytes": delta.nbytes, "sync/kind": 1.0}
        return self._full_from_synced(version), {**metrics, "sync/bytes": full_bytes,
                                                 "sync/kind": 0.0}

    def _full_from_synced(self, version: int) -> WeightUpdate:
        """A full update of the synced copy (every name, tied ones to the same tensor)."""
        tensors = {name: self.synced[first] for name, first in self.aliases.items()}
        return WeightUpdate(version, tensors, checksums=checksums(self.synced))

    def push(self, in_flight: str = "continue") -> dict[str, float]:
        """Sync the trainer's current version to the engine (`in_flight`: what its running
        requests do, see `update_weights`) and check it; the metrics
        (sync/bytes, sync/full_bytes, sync/kind 0 full / 1 delta, sync/changed_frac,
        sync/time_s, sync/parity_mean_abs, sync/parity_max_abs). Any failure raises."""
        t0 = time.perf_counter()
        version = self.trainer.version
        try:
            update, metrics = self.build(version)
            try:
                applied = self.engine.update_weights(update, in_flight=in_flight,
                                                     timeout_s=self.cfg.timeout_s)
            except (WeightSyncError, RunError) as e:
                # the receivers' refusal of a delta whose base they do not hold says "is
                # against" (the embedded engine, and tiller serve through the HTTP error), for
                # a gathered delta and for per-rank parts with a delta among them alike
                if getattr(update, "base_version", None) is None or "is against" not in str(e):
                    raise
                # e.g. a server restarted behind our back refuses a delta against a base it
                # does not hold: one full update brings every engine to the version (with
                # `base` None, `build` writes full: every rank's part, under per_rank)
                logger.warning("weight sync v%d: the delta was refused (%s); pushing a full "
                               "update instead", version, e)
                self.base = None
                update, metrics = self.build(version)
                metrics["sync/delta_refused"] = 1.0
                applied = self.engine.update_weights(update, in_flight=in_flight,
                                                     timeout_s=self.cfg.timeout_s)
        except BaseException:
            self.base = None  # the engine (or the synced copy) may hold anything: next is full
            raise
        if applied != version:
            self.base = None
            raise WeightSyncError(f"weight sync v{version}: the engine echoed version {applied}")
        self.base = version
        kind = "delta" if metrics["sync/kind"] else "full"
        logger.info("weight sync v%d: %s, %d bytes (full: %d), %.2f%% of elements changed",
                    version, kind, metrics["sync/bytes"], metrics["sync/full_bytes"],
                    100 * metrics["sync/changed_frac"])
        metrics.update(self.check_parity(version))
        metrics["sync/time_s"] = time.perf_counter() - t0
        return {k: float(v) for k, v in metrics.items()}

    def trainer_scores(self) -> list[float]:
        return self.trainer.score(self.probe)

    def check_parity(self, version: int) -> dict[str, float]:
        """Score the probe on the trainer and on the engine (each HTTP server); raise
        `WeightSyncError` when the mean |logprob difference| on any is above `parity_tol`."""
        want = np.array(self.trainer_scores())
        if hasattr(self.engine, "score_servers"):
            scored = self.engine.score_servers(self.probe, timeout_s=self.cfg.timeout_s)
        else:
            scored = {"the embedded engine": self.engine.score(self.probe,
                                                               timeout_s=self.cfg.timeout_s)}
        worst_mean = worst_max = 0.0
        for where, got in scored.items():
            diff = np.abs(np.array(got) - want)
            mean, peak = float(diff.mean()), float(diff.max())
            if not mean <= self.cfg.parity_tol:  # NaN fails too
                self.base = None
                raise WeightSyncError(
                    f"weight sync v{version}: parity check failed on {where}: mean |logprob "
                    f"difference| to the trainer {mean:.4g} > weight_sync.parity_tol "
                    f"{self.cfg.parity_tol:g} (max {peak:.4g}, {len(got)} probe tokens): the "
                    f"engine does not hold the trainer's weights")
            worst_mean, worst_max = max(worst_mean, mean), max(worst_max, peak)
        logger.info("weight sync v%d: parity checked on %s (mean |logprob difference| at most "
                    "%.3g)", version, ", ".join(scored), worst_mean)
        return {"sync/parity_mean_abs": worst_mean, "sync/parity_max_abs": worst_max}


class Ranks(Protocol):
    """The trainer's ranks as per-rank parts need them (`train.distributed.Leading`)."""

    version: int
    publisher: Publisher

    def use_parts(self) -> None: ...

    def write_parts(self, folder: str, version: int, base: int | None, dtype: torch.dtype,
                    mode: str) -> list[dict[str, float]]: ...

    def score_probe(self, token_ids: list[int]) -> list[float]: ...


class ShardedSync(WeightSync):
    """weight_sync.shards: per_rank. Each trainer rank writes its own shard's part of every
    version (full, or a delta against what it last synced: `engine.parts`) into the version's
    folder of the engine's servers (`tiller serve` over HTTP: `new_weights_folder`), with no gather
    to rank 0; rank 0 then has every server load the version, which each applies only with
    every rank's part there (`engine.parts.PartsUpdate`). The parity probe is scored by the
    sharded model. Metrics as `WeightSync`'s, plus per rank `sync/part{r}_bytes` and
    `sync/part{r}_s` (its diff and write)."""

    def __init__(self, ranks: Ranks, engine: Any, cfg: WeightSyncConfig,
                 engine_dtype: torch.dtype):
        if not (getattr(engine, "takes_deltas", False)
                and hasattr(engine, "new_weights_folder")):
            raise ConfigError(f"config field weight_sync.shards: got per_rank with "
                              f"{type(engine).__name__}; per-rank parts go to tiller serve "
                              f"servers over HTTP only (use shards: gathered)")
        super().__init__(ranks.publisher, engine, cfg, engine_dtype)
        # the version pushed is the ranks' (rank 0's full copy lags until `gathered`)
        self.trainer = self.ranks = ranks  # type: ignore[assignment]
        ranks.use_parts()
        self.synced_once = False  # whether every rank holds a synced copy of its shard

    def _engine_may_lack_base(self) -> bool:
        down = any(s.down for s in self.engine.servers)
        return not self.synced_once or self.base != self.engine.version or down

    def trainer_scores(self) -> list[float]:
        return self.ranks.score_probe(self.probe)

    @torch.no_grad()
    def build(self, version: int) -> tuple[PartsUpdate, dict[str, float]]:  # type: ignore[override]
        full = self.mode == "full" or self._engine_may_lack_base()
        base = None if full else self.base
        folder = self.engine.new_weights_folder(version)  # what a killed run left removed
        try:
            stats = self.ranks.write_parts(str(folder), version, base, self.dtype, self.mode)
        except BaseException:
            self.synced_once = False
            remove_tree(folder)
            raise
        self.synced_once = True
        delta = any(st["delta"] for st in stats)
        metrics = {"sync/bytes": sum(st["bytes"] for st in stats),
                   "sync/full_bytes": sum(st["full_bytes"] for st in stats),
                   "sync/kind": float(delta),
                   "sync/changed_frac": sum(st["changed"] for st in stats) / max(
                       1.0, sum(st["numel"] for st in stats))}
        for r, st in enumerate(stats):
            metrics[f"sync/part{r}_bytes"], metrics[f"sync/part{r}_s"] = st["bytes"], st["seconds"]
        return PartsUpdate(version, base if delta else None, len(stats)), metrics
