"""Trainer ranks over torch.distributed (`train.world_size` > 1): the policy sharded with FSDP2
(`torch.distributed.fsdp.fully_shard`) over N ranks, on CPU with gloo.

Rank 0 is the run's own `RankTrainer`, the leader: every call that trains (`set_optimizer`,
`sft_step`, `rl_step`) goes first to the other ranks (`Follower`s, in spawned processes or Ray
actors: `train.ranks`) and then runs here, so every rank runs the same passes. Each optimizer
batch is split across the ranks by tokens (`rank_rows`); the loss normalizers stay those of
the whole optimizer batch (`batch.minibatches`), so with the gradients summed over the ranks

    sum_r grad( sum_{i in rows_r} L_i / N_global ) = grad( sum_i L_i / N_global )

equals the single-rank gradient in every aggregation mode, and `clip_grad_norm_` over the
sharded gradients clips by the global norm. After each step the full weights are gathered into
rank 0's plain copy (`publisher`), which weight sync pushes to the engine, the parity check
scores and `Run.save` writes; with weight_sync.shards per_rank (`use_parts`) no step gathers:
each rank writes its own shard's part of every version (`write_part`, `engine.parts`), the
probe is scored by the sharded model (`score_probe`) and the copy is gathered only before it is
saved (`Leader.gathered`).

A checkpoint (`resume.save_rl`) gathers the rest of the ranks' state to rank 0 (`state`): the
optimizer's, full (`get_optimizer_state_dict(full_state_dict=True)`, keyed by parameter
name), the sharded KL reference model's and critic's (value model and optimizer) whole, and
every rank's RNG states; a resume hands it back (`load_state`): each broadcast from rank 0
and resharded, under model.lora rank 0's reference adapter too, each rank its own RNG states
and the weight version.
"""

from __future__ import annotations

import copy
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from tiller.config import CriticConfig, LoRAConfig, TrainConfig
from tiller.engine.parts import ShardCopy, part_name
from tiller.engine.updates import WeightUpdate
from tiller.errors import RunError
from tiller.train.batch import Batch
from tiller.train.lora import REFERENCE, Lora, LoraTrainer
from tiller.train.process_state import pause, rng_state, set_rng_state
from tiller.train.rows import Rows
from tiller.train.sharding import broadcast_from_rank0, copy_shards, rank_rows, resharded, shard
from tiller.train.trainer import PolicyTrainer

if TYPE_CHECKING:
    from tiller.train.critic import Critic

log = logging.getLogger(__name__)

STOP_TIMEOUT_S = 30.0  # how long `Leading.close` gives the idle ranks, together, to exit
# what every rank runs, in the same order: the calls that train (the weights move), those
# that set up the optimizer, the KL reference model and the critic, and a checkpoint's gather
# and a resume's load of the ranks' state
TRAINING = ("sft_step", "rl_step")
STEPS = ("set_optimizer", "reference", "drop_reference", "new_critic", "critic_state",
         "state", "load_state", "use_parts", "write_part", "score_probe", "gather", *TRAINING)
# RankState: what a checkpoint holds of one rank besides the weights: its Python and numpy
# RNG states (JSON) and torch's (tensors), as `train.process_state.rng_state` gives them
RankState = tuple[dict[str, Any], dict[str, torch.Tensor]]
# a checkpoint's gather: each tensor whole on rank 0, on the CPU; a resume's load: broadcast
# from rank 0, each rank keeping its shard
WHOLE = StateDictOptions(full_state_dict=True, cpu_offload=True)
FROM_RANK0 = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)


@dataclass(frozen=True)
class TrainerOptions:
    """What builds a `PolicyTrainer` on every rank (its constructor's keyword arguments)."""

    temperature: float = 1.0
    compute_dtype: torch.dtype = torch.float32
    top_k: int = 0
    top_p: float = 1.0
    dropout: Literal["keep", "off"] = "off"
    train: TrainConfig = field(default_factory=TrainConfig)  # the same train.* on every rank


class RankRows(Rows):
    """Rank `rank`'s walk over a batch's rows (`rank_rows`): its share of each optimizer batch,
    passes that add nothing where it is short of rows, metric sums and per-row tensors summed
    over the ranks, and the models it trains or runs sharded with FSDP2 (`shard`)."""

    def __init__(self, train: TrainConfig, rank: int, world: int):
        super().__init__(train)
        self.rank, self.world = rank, world
        self.owned: set[int] = set()  # the batch rows this rank computed since the last reduce

    def share(self, rows: torch.Tensor, lengths: torch.Tensor, size: int
              ) -> list[torch.Tensor]:
        micros = rank_rows(rows, lengths, self.world, self.rank, size,
                           self.train.micro_batch_tokens, self.train.packing)
        self.owned.update(int(i) for m in micros for i in m if i >= 0)
        return micros

    def pass_batch(self, batch: Batch, rows: torch.Tensor, device: torch.device) -> Batch:
        mb = batch.rows(rows)
        if bool((rows < 0).any()):  # a rank short of rows: a pass that adds nothing
            mb.loss_mask = torch.zeros_like(mb.loss_mask)
            # its rollout logprobs 0 like its logp_old (trainer._on): the off-policy weight is
            # exp(0 - 0) = 1. The built-in corrections cap their weight; a plugin's might not,
            # and exp(0 - rollout logprob) overflows to inf below -88.7 (inf x 0 = NaN)
            mb.rollout_logprobs = torch.zeros_like(mb.rollout_logprobs)
        return mb.to(device)

    def reduce(self, sums: dict[str, float]) -> dict[str, float]:
        keys = sorted(sums)
        values = torch.tensor([sums[k] for k in keys], dtype=torch.float64)
        dist.all_reduce(values)
        return dict(zip(keys, values.tolist(), strict=True))

    def reduce_rows(self, per_row: torch.Tensor) -> torch.Tensor:
        keep = torch.zeros(len(per_row), dtype=torch.bool)
        keep[list(self.owned)] = True
        self.owned.clear()
        out = per_row * keep[:, None]
        dist.all_reduce(out)
        return out

    def sharded(self, module: nn.Module) -> nn.Module:
        return shard(module)


class RankSteps:
    """What a rank's trainer (a `PolicyTrainer` with `RankRows`) adds: `run`, which runs each
    of `STEPS` as rank 0 sent it, and the reference model and critic this rank holds (rank 0's
    `Leading` sends flags for them: the modules stay on their ranks)."""

    rows: RankRows
    optimizer: torch.optim.Optimizer | None
    ref: nn.Module | None = None
    critic: Critic | None = None

    @property
    def rank(self) -> int:
        return self.rows.rank

    @property
    def world(self) -> int:
        return self.rows.world

    def run(self, name: str, args: tuple, lrs: list[float]) -> Any:
        """One step of `STEPS` on this rank, at the leader's learning rates (its LR
        schedule); a step that trains ends with `after_step`."""
        if name not in STEPS:
            raise ValueError(f"not a trainer step: {name!r}")
        # this rank's own method (rank 0's `Leading` sends its calls to every rank first)
        own = getattr(super(Leading, self) if isinstance(self, Leading) else self, name)
        if name not in TRAINING:
            out = own(*args)
            if name == "reference":
                self.ref = out
            elif name == "drop_reference":
                self.ref = None
            elif name == "new_critic":
                self.critic = out
            return out
        assert self.optimizer is not None, "call set_optimizer first"
        for group, lr in zip(self.optimizer.param_groups, lrs, strict=True):
            group["lr"] = lr
        self.rows.owned.clear()
        if name == "rl_step":  # the flags rank 0 sent: this rank's own reference and critic
            batch, cfg, l_max, with_ref, with_critic, step = args
            if (with_ref and self.ref is None) or (with_critic and self.critic is None):
                raise RuntimeError(f"trainer rank {self.rank}: rl_step with a reference or "
                                   "critic this rank has not made")
            args = (batch, cfg, l_max, self.ref if with_ref else None,
                    self.critic if with_critic else None, step)
        out = own(*args)
        return self.after_step(out)

    def after_step(self, out: Any) -> Any:
        return out

    def critic_state(self) -> dict[str, torch.Tensor]:
        """The critic's value model whole (its state dict) on rank 0, {} on the others (a
        collective: every rank gathers its shards)."""
        assert self.critic is not None, "no critic: call new_critic first"
        return get_model_state_dict(self.critic.model, options=WHOLE)

    def own_ref(self) -> bool:
        """This rank holds a reference model of its own (sharded like the policy); under
        model.lora the reference is the policy with its reference adapter."""
        return self.ref is not None and self.ref is not self.model

    def state(self) -> tuple[dict[str, Any], list[RankState]] | None:
        """A checkpoint's share of this rank (a collective: every rank calls it): on rank 0
        trainer.pt's parts (`resume.learner_tensors`' names), each tensor whole on the CPU:
        the optimizer's state ("optimizer", keyed by parameter name:
        `get_optimizer_state_dict(full_state_dict=True)`), the reference model's weights
        ("ref", while the ranks hold one: as a single rank's checkpoint holds them), the
        critic's ("critic", as one rank's, and "critic_optimizer", keyed by parameter name);
        and every rank's RNG states, by rank. None on the others. Rank 0 first waits at the
        checkpoint test hook's "ranks" phase (`train.process_state.PAUSE_ENV`), the others
        already in the gather."""
        assert self.optimizer is not None, "call set_optimizer first"
        if self.rank == 0:
            pause("ranks")
        parts = {"optimizer": get_optimizer_state_dict(resharded(self.model), self.optimizer,
                                                       options=WHOLE)}
        if self.own_ref():
            parts["ref"] = get_model_state_dict(resharded(self.ref), options=WHOLE)
        if self.critic is not None:
            # (not `critic_state`: rank 0's sends it to every rank)
            parts["critic"] = get_model_state_dict(resharded(self.critic.model), options=WHOLE)
            parts["critic_optimizer"] = get_optimizer_state_dict(
                self.critic.model, self.critic.optimizer, options=WHOLE)
        rngs: list[Any] | None = [None] * self.world if self.rank == 0 else None
        dist.gather_object(rng_state(), rngs, dst=0)
        return (parts, rngs) if rngs is not None else None

    def load_state(self, parts: dict[str, Any] | None, rng: RankState | None,
                   version: int) -> None:
        """A resume's share of this rank (a collective): `state`'s `parts` (rank 0's, None on
        the others) broadcast from rank 0, each rank keeping its shards: the optimizer's, and
        the reference model's and critic's where this rank holds them (the ranks built them
        as the checkpointed run did; `resume.check_tensors` checked the parts fit); under
        model.lora rank 0's reference adapter (`load_reference`); this rank's RNG states
        `rng` (rank 0's are put back with the run's, None here) and the checkpoint's weight
        version (what staleness is measured against)."""
        assert self.optimizer is not None, "call set_optimizer first"
        parts = parts or {}
        set_optimizer_state_dict(resharded(self.model), self.optimizer,
                                 parts.get("optimizer", {}), options=FROM_RANK0)
        # (copies: loading a model's puts this rank's shards into the dict it is given)
        if self.own_ref():
            set_model_state_dict(resharded(self.ref), dict(parts.get("ref", {})),
                                 options=FROM_RANK0)
        self.load_reference()
        if self.critic is not None:
            set_model_state_dict(resharded(self.critic.model), dict(parts.get("critic", {})),
                                 options=FROM_RANK0)
            set_optimizer_state_dict(self.critic.model, self.critic.optimizer,
                                     parts.get("critic_optimizer", {}), options=FROM_RANK0)
        if rng is not None:
            set_rng_state(*rng)
        self.version = self.publisher.version = version

    def load_reference(self) -> None:
        """A resume's reference adapter (model.lora: `LoraRankTrainer`); nothing here."""


class RankTrainer(RankSteps, PolicyTrainer):
    """One rank's trainer over the sharded policy (FSDP2). `full` is the plain (unsharded)
    model: on rank 0 it receives the gathered weights after every step (`publisher`)."""

    def __init__(self, full: nn.Module, rank: int, world: int, options: TrainerOptions):
        PolicyTrainer.__init__(self, shard(copy.deepcopy(full)), **vars(options))
        self.rows = RankRows(self.train, rank, world)
        self.full = full
        self.view = PolicyTrainer(full, **vars(options))  # rank 0's publisher
        self.parts: ShardCopy | None = None  # weight_sync.shards per_rank: what was synced

    @property
    def publisher(self) -> PolicyTrainer:
        """The gathered full weights at this trainer's version (rank 0)."""
        return self.view

    def weight_update(self) -> WeightUpdate:
        return self.publisher.weight_update()

    def score(self, token_ids: list[int]) -> list[float]:
        return self.publisher.score(token_ids)

    def reference(self) -> nn.Module:
        """The KL reference, sharded like the policy: each rank's shards a copy of its policy
        shards now, in the compute dtype (no communication: FSDP2 cuts every tensor the same
        way on dim 0, so the two models' local shards line up)."""
        ref = shard(copy.deepcopy(self.full).to(self.compute_dtype).requires_grad_(False))
        copy_shards(ref, self.model)
        return ref.eval()

    def new_critic(self, cfg: CriticConfig) -> Critic:
        """The critic from the policy now, its value model sharded like the policy: its
        backbone's shards copied from the policy's (the head starts at zero)."""
        from tiller.train.critic import Critic

        critic = Critic(self.full, cfg, self.dropout, self.train, self.rows)
        copy_shards(critic.model.backbone, self.model.base_model)
        return critic

    def after_step(self, out: Any) -> Any:
        """The full weights gathered into `full` (rank 0 keeps them); a step's metrics gain
        the gather's seconds and bytes (`train/gather_s`, `train/gather_bytes`: weight sync
        computes its delta on this gathered copy). Not with per-rank parts (`use_parts`):
        `Leading.gathered` gathers when the full copy is read."""
        if self.parts is not None:
            return out
        t0 = time.perf_counter()
        gathered = self.gather()
        if isinstance(out, dict):
            out.update({"train/gather_s": time.perf_counter() - t0,
                        "train/gather_bytes": float(gathered)})
        return out

    def gather(self) -> int:
        """The full weights into `full` on rank 0 (a collective: every rank calls it); the
        bytes gathered there."""
        state = get_model_state_dict(self.model, options=WHOLE)
        if self.rank == 0:
            self.full.load_state_dict(state)
        self.view.version = self.version
        return sum(t.numel() * t.element_size() for t in state.values()) if self.rank == 0 else 0

    def use_parts(self) -> None:
        """weight_sync.shards per_rank: from now on each rank writes its own part of every
        version (`write_part`) and no step gathers the full weights."""
        self.parts = ShardCopy(self.model, self.rank, self.world)

    def write_part(self, folder: str, version: int, base: int | None, dtype: torch.dtype,
                   mode: str) -> list[dict[str, float]] | None:
        """This rank's part of `version` into `folder` (`engine.parts.ShardCopy.write`: full
        when `base` is None), then every rank's figures (and the seconds it took) gathered
        to rank 0, by rank (a collective); None on the others."""
        assert self.parts is not None, "call use_parts first"
        t0 = time.perf_counter()
        path = Path(folder) / part_name(self.rank)
        stats = self.parts.write(path, Path(folder), version, base, dtype, mode)
        stats["seconds"] = time.perf_counter() - t0
        out: list[Any] | None = [None] * self.world if self.rank == 0 else None
        dist.gather_object(stats, out, dst=0)
        return out

    def score_probe(self, token_ids: list[int]) -> list[float]:
        """The parity probe scored by the sharded model (a collective: every rank runs the
        forward), for per-rank parts, where rank 0's full copy is not kept current."""
        return PolicyTrainer.score(self, token_ids)


class LoraRankTrainer(RankSteps, LoraTrainer):
    """One rank's trainer under model.lora: every rank holds the frozen base whole and its own
    `Lora` (the adapters start as rank 0's, broadcast); after each rank's passes the adapters'
    gradients are summed over the ranks (one all-reduce of them all, what DDP computes), so
    the clip sees the global norm and every rank takes the same optimizer step. Rank 0's
    merged model is what weight sync reads: no gather. The KL reference is each rank's own
    frozen reference adapter, as on one rank."""

    def __init__(self, lora: Lora, rank: int, world: int, options: TrainerOptions):
        LoraTrainer.__init__(self, lora, **vars(options))
        self.rows = RankRows(self.train, rank, world)
        broadcast_from_rank0(self._adapters())
        lora.merge()

    def _adapters(self) -> list[nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    def load_reference(self) -> None:
        """Rank 0's reference adapter (a resume loaded the checkpoint's there) on every rank,
        while there is one (each rank made its own: `reference`)."""
        if self.lora.has_reference():
            broadcast_from_rank0(self.lora.adapter_weights(REFERENCE))

    def _step(self, max_grad_norm: float) -> float:
        adapters = self._adapters()
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in adapters]
        flat = torch.cat([g.flatten() for g in grads])
        dist.all_reduce(flat)
        for p, g in zip(adapters, flat.split([p.numel() for p in adapters]), strict=True):
            p.grad = g.view_as(p)
        return super()._step(max_grad_norm)


class Rank(Protocol):
    """Rank 0's handle on another rank: a spawned process or a Ray actor (`train.ranks`)."""

    rank: int

    def send(self, name: str, args: tuple, lrs: list[float]) -> None: ...

    def wait(self, timeout_s: float) -> None:
        """The last call's end; raises `RunError` naming the rank when it failed or died."""
        ...

    def died_starting(self) -> str | None:
        """How the rank died before joining the process group ("exit code 1", "Ray actor:
        ..."), or None while it lives."""
        ...

    def ended(self) -> str | None:
        """How the rank's last call ended badly ("died (exit code -9)", "failed (ValueError:
        ...)"), or None while it runs or when it succeeded."""
        ...

    def answered(self) -> bool:
        """Whether the last call (if any) has answered, or the rank is gone; without waiting."""
        ...

    def stop(self, deadline: float) -> None:
        """The rank stopped: told to stop and given until `deadline` (`time.monotonic`) to
        exit when idle, killed at once while its last call has not answered (it waits in a
        collective rank 0 has left, until train.rank_timeout_s, and would not read the stop)."""
        ...


class HeldFolder(Protocol):
    """The ranks' rendezvous folder on one node, held by rank 0 (`ranks.RendezvousFolder`)."""

    path: str
    def remove(self) -> None: ...


class Leading:
    """Rank 0: every call goes to the other ranks first, then runs here (mixed into a rank's
    trainer: `Leader`, `LoraLeader`)."""

    ranks: list[Rank]
    timeout_s: float
    rendezvous: HeldFolder | None
    optimizer: torch.optim.Optimizer | None

    def __init__(self, first: Any, world: int, options: TrainerOptions, ranks: list[Rank],
                 timeout_s: float, rendezvous: HeldFolder | None = None):
        """`first`: what the rank's trainer is built from (the full model, or rank 0's `Lora`);
        `rendezvous`: the ranks' rendezvous folder on one node, removed by `close`."""
        super().__init__(first, 0, world, options)  # type: ignore[call-arg]
        self.ranks, self.timeout_s, self.rendezvous = ranks, timeout_s, rendezvous

    def _everywhere(self, name: str, args: tuple, by_rank: list[tuple] | None = None) -> Any:
        """`name` run on every rank, with `args`, or with `by_rank[r]` on rank r."""
        lrs = ([g["lr"] for g in self.optimizer.param_groups] if self.optimizer is not None
               else [])
        for r in self.ranks:
            r.send(name, args if by_rank is None else by_rank[r.rank], lrs)
        t0 = time.monotonic()
        try:
            out = self.run(name, args if by_rank is None else by_rank[0], lrs)
        except Exception as e:  # a collective that failed: a rank that died or failed says which
            for r in self.ranks:
                if (how := r.ended()) is not None:
                    raise RunError(f"trainer rank {r.rank} {how} during {name}") from e
            silent = [r.rank for r in self.ranks if not r.answered()]
            if silent and time.monotonic() - t0 >= self.timeout_s:  # a collective timed out
                first = str(e).splitlines()[0] if str(e) else ""
                raise RunError(f"trainer rank(s) {silent} did not take part in {name} within "
                               f"train.rank_timeout_s={self.timeout_s:g} (alive, not "
                               f"answering; {type(e).__name__}: {first})") from e
            raise
        for r in self.ranks:
            r.wait(self.timeout_s)
        return out

    def set_optimizer(self, *args: Any) -> None:
        self._everywhere("set_optimizer", args)

    def sft_step(self, *args: Any) -> dict:
        return self._everywhere("sft_step", args)

    def reference(self) -> nn.Module:
        return self._everywhere("reference", ())

    def drop_reference(self) -> None:
        self._everywhere("drop_reference", ())

    def new_critic(self, cfg: CriticConfig) -> Critic:
        return self._everywhere("new_critic", (cfg,))

    def critic_state(self) -> dict[str, torch.Tensor]:
        return self._everywhere("critic_state", ())

    def rl_step(self, batch: Batch, cfg: Any, l_max: int, ref_model: nn.Module | None = None,
                critic: Any = None, step: int = 0) -> dict[str, float]:
        """Every rank runs it with its own reference model and critic (those `reference` and
        `new_critic` made on each rank; here rank 0's)."""
        if (ref_model is not None and ref_model is not self.ref) or (
                critic is not None and critic is not self.critic):
            raise RunError("train.world_size > 1: the reference model and critic are the "
                           "ones the trainer's ranks made (reference, new_critic)")
        return self._everywhere("rl_step", (batch, cfg, l_max, ref_model is not None,
                                            critic is not None, step))

    def use_parts(self) -> None:
        self._everywhere("use_parts", ())

    def write_parts(self, folder: str, version: int, base: int | None, dtype: torch.dtype,
                    mode: str) -> list[dict[str, float]]:
        """Every rank's part of `version` written into `folder`; their figures, by rank."""
        return self._everywhere("write_part", (folder, version, base, dtype, mode))

    def score_probe(self, token_ids: list[int]) -> list[float]:
        return self._everywhere("score_probe", (token_ids,))

    def checkpoint_state(self) -> tuple[dict[str, Any], list[RankState]]:
        """trainer.pt's parts (the optimizer's full state, the reference model's and the
        critic's) and every rank's RNG states (`RankSteps.state`), gathered here from every
        rank."""
        return self._everywhere("state", ())

    def load_checkpoint_state(self, parts: dict[str, Any], rngs: list[RankState | None],
                              version: int) -> None:
        """`checkpoint_state`'s `parts` and `rngs` (rank 0's entry None: the run puts its RNG
        states back itself) and the weight version, put back on every rank (under model.lora
        with rank 0's reference adapter: a resume loads it there first); a checkpoint of
        another world size does not get here (`resume.check_config` refuses
        train.world_size changed)."""
        if len(rngs) != self.world:
            raise ValueError(f"{len(rngs)} ranks' RNG states for {self.world} ranks")
        self._everywhere("load_state", (), [(parts if r == 0 else None, rngs[r], version)
                                            for r in range(self.world)])

    def close(self) -> None:
        """Stop every other rank (under one deadline, `STOP_TIMEOUT_S`; those still in a call
        killed at once), leave the process group, remove the rendezvous folder."""
        try:
            busy = [r.rank for r in self.ranks if not r.answered()]
            if busy:
                log.warning("closing: %d trainer rank(s) %s still in a call rank 0 has left: "
                            "killed", len(busy), busy)
            deadline = time.monotonic() + STOP_TIMEOUT_S
            for r in self.ranks:
                r.stop(deadline)
            if dist.is_initialized():
                dist.destroy_process_group()
        finally:
            if self.rendezvous is not None:
                self.rendezvous.remove()


class Leader(Leading, RankTrainer):
    """Rank 0 over the sharded policy."""

    def gathered(self) -> None:
        """The full weights gathered into rank 0's copy when a step since moved them (with
        per-rank parts no step gathers): before the copy is saved."""
        if self.publisher.version != self.version:
            self._everywhere("gather", ())


class LoraLeader(Leading, LoraRankTrainer):
    """Rank 0 under model.lora."""


def rank_trainer(first: Any, lora: LoRAConfig | None, rank: int, world: int,
                 options: TrainerOptions) -> RankTrainer | LoraRankTrainer:
    """Rank `rank`'s (> 0) trainer: over the sharded full model `first`, or under model.lora
    over its own `Lora` of the base model `first` (a copy; its adapters rank 0's)."""
    if lora is None:
        return RankTrainer(first, rank, world, options)
    return LoraRankTrainer(Lora(copy.deepcopy(first), lora), rank, world, options)
