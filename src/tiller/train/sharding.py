"""How a batch and a model are split over trainer ranks (`train.distributed`): each rank's
share of the batch rows (`rank_rows`), the policy sharded with FSDP2 (`shard`), and the moves
of sharded parameters (`resharded`, `copy_shards`, `broadcast_from_rank0`)."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from tiller.train.batch import micro_batches


def rank_rows(rows: torch.Tensor, lengths: torch.Tensor, world: int, rank: int, size: int,
              max_tokens: int | None = None, packed: bool = False) -> list[torch.Tensor]:
    """Rank `rank`'s micro-batches of the batch rows `rows` (`lengths`: every batch row's
    length). The rows, sorted by length, are dealt to the ranks in snake order
    (0, 1, ..., W-1, W-1, ..., 0), so each rank gets as many rows as the others (or one fewer)
    and about as many tokens. Without `max_tokens` each rank splits its rows into
    K = ceil(ceil(n / W) / size) passes; with it (`train.micro_batch_tokens`), each rank's rows
    are cut like one rank's (`batch.micro_batches`: at most `size` rows and `max_tokens`
    tokens, packed or padded) and K is the most passes any rank needs. Every rank runs K
    passes (FSDP2 gathers and reduces in each, on every rank); a rank left with fewer runs its
    empty passes on another rank's row with the loss mask zeroed, marked by a negative index
    (row - B, B = len(lengths)): they add nothing to the loss, the gradient or any metric."""
    order = rows[torch.argsort(lengths[rows], stable=True)]
    position = torch.arange(len(order))
    lap, seat = position // world, position % world
    owner = torch.where(lap % 2 == 0, seat, world - 1 - seat)
    dummy = order[:1] - len(lengths)
    if max_tokens is None:
        most = math.ceil(len(order) / world)  # the rows of the rank with the most
        passes = max(1, math.ceil(most / size))
        return [chunk if len(chunk) else dummy
                for chunk in torch.tensor_split(order[owner == rank], passes)]
    shares = [order[owner == r] for r in range(world)]
    micros = [[share[idx] for idx in micro_batches(lengths[share], size, max_tokens, packed)]
              for share in shares]
    passes = max(1, *(len(m) for m in micros))
    return micros[rank] + [dummy] * (passes - len(micros[rank]))


def shard(model: nn.Module) -> nn.Module:
    """`model` sharded with FSDP2 in place: each block of `model._no_split_modules` (a
    transformers model's decoder layers) its own unit, then the rest; gradients summed over the
    ranks, not averaged (the loss normalizers are already global)."""
    blocks = set(getattr(model, "_no_split_modules", None) or ())
    for module in model.modules():
        if type(module).__name__ in blocks:
            fully_shard(module)
    fully_shard(model)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
    return model


def resharded(module: nn.Module) -> nn.Module:
    """`module` with the parameters of each of its FSDP2 units sharded (a module `shard` did
    not shard, such as a LoRA rank's policy, is left as it is): a forward pass with no backward
    after it (the KL reference's, the logprob prepass) leaves the root unit's whole, and a
    state dict loaded into them then fails (whole tensors where the dict holds shards)."""
    for unit in module.modules():
        if isinstance(unit, FSDPModule):
            unit.reshard()
    return module


@torch.no_grad()
def copy_shards(dst: nn.Module, src: nn.Module) -> None:
    """Each parameter of `dst` := `src`'s of the same name, shard by shard (both sharded by
    `shard` over the same ranks; cast to `dst`'s dtype)."""
    params = dict(src.named_parameters())
    for name, p in dst.named_parameters():
        p.to_local().copy_(params[name].to_local())


@torch.no_grad()
def broadcast_from_rank0(params: list[nn.Parameter]) -> None:
    """Every rank's `params` := rank 0's (a collective: one broadcast of them all)."""
    flat = parameters_to_vector(params).detach()
    dist.broadcast(flat, 0)
    vector_to_parameters(flat, params)
