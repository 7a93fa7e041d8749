"""The policy's log-probabilities (and entropies) on exactly a batch's ids, in bounded memory.

Position t of `logp` is log pi(token_t | tokens_<t), so it lines up with `loss_mask` and the
engine's `rollout_logprobs` index for index (0 at t = 0 and off each row's length).

Memory, for T tokens and a vocabulary of V:
- the transformer runs once over the micro-batch, padded ([B, L_max]) or packed (one row of
  sum_i L_i tokens, `TrainConfig.packing`): position ids restart at 0 on each sequence and,
  with no 2D attention mask and no KV cache (`use_cache=False`: with a cache transformers
  skips the check), its mask builder (`find_packed_sequence_indices`) keeps attention within
  each sequence (eager and sdpa, tested), so no padding token is computed;
- the output layer, the log-softmax, the gather and the entropy run over the T - B predicting
  positions `chunk_tokens` at a time, each chunk under activation checkpointing: the backward
  pass recomputes one chunk's [chunk, V] logits at a time, so the full [T, V] fp32 matrix
  never exists (it is 4 T V bytes: 805 MB for 8 x 512 tokens and V = 49,152, times the copies
  autograd keeps).
Both are exact rearrangements of the same arithmetic; only float rounding differs
(tests/test_trainer_memory.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.utils.checkpoint import checkpoint
from transformers.modeling_layers import GradientCheckpointingLayer

from tiller.train.batch import Batch
from tiller.train.truncation import truncated_token_logprobs


@dataclass(frozen=True)
class PassShape:
    """How a pass lays out its tokens (`TrainConfig`): packed or padded, and the positions
    per chunk of the output layer."""

    packing: bool = False
    chunk_tokens: int = 256


def trunk_and_head(model: nn.Module) -> tuple[Callable[..., Any], nn.Module]:
    """The transformer that returns last hidden states and the output layer of a Hugging Face
    causal LM (or a peft model around one: its LoRA layers live inside the same modules); for
    a model sharded with FSDP2, the transformer runs inside the root's forward
    (`_through_root`)."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    trunk = inner.base_model
    if isinstance(model, FSDPModule):
        trunk = partial(_through_root, model, trunk)
    return trunk, inner.get_output_embeddings()


@torch.no_grad()
def check_plain_head(model: nn.Module) -> None:
    """Refuse, in one line naming the model's class, a model whose logits are not its output
    layer applied to the trunk's last hidden states (softcapping, a logit scale such as
    Granite's `logits_scaling`, ...): the chunked output layer (`token_logprobs`) would give
    wrong logprobs silently. One short row through both, at start-up; they must agree to
    max |difference| <= tol * max(1, max |logits|), tol = max(1e-4, 8 eps of the dtype)."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    trunk, head = trunk_and_head(model)
    was_training = model.training
    model.eval()
    try:
        ids = torch.arange(1, min(9, head.weight.size(0)), device=head.weight.device)[None]
        full = model(input_ids=ids, use_cache=False).logits.float()
        chunked = head(trunk(input_ids=ids, use_cache=False).last_hidden_state).float()
    finally:
        model.train(was_training)
    tol = max(1e-4, 8 * torch.finfo(full.dtype).eps) * max(1.0, float(full.abs().max()))
    gap = float((full - chunked).abs().max())
    if gap > tol:
        raise ValueError(f"{type(inner).__name__}: its logits are not its output layer on the "
                         f"last hidden states (max difference {gap:.3g}; it post-processes "
                         "them); the chunked output layer supports plain linear heads only")


def _through_root(root: nn.Module, trunk: nn.Module, **inputs: Any) -> Any:
    """The trunk's output from the FSDP2 root's own forward, asked for no position's logits
    (`logits_to_keep` an empty index) and taken by a forward hook. Calling the trunk directly
    would skip the root's hooks: its own parameters (embeddings, final norm, output layer)
    would stay sharded. The root keeps them gathered after its forward (FSDP2 does not reshard
    the root after forward) until the backward pass ends, so the chunked output layer and its
    recomputation use them, and their gradients are reduced with the rest."""
    out: list[Any] = []
    handle = trunk.register_forward_hook(lambda _module, _args, output: out.append(output))
    none = torch.zeros(0, dtype=torch.long, device=inputs["input_ids"].device)
    try:
        root(**inputs, logits_to_keep=none)
    finally:
        handle.remove()
    return out[0]


def flag_checkpointed_layers(model: nn.Module) -> None:
    """Mark a model's transformer layers (not their submodules) as training: transformers
    checkpoints a layer only in training mode, and the gradient passes under `model.dropout:
    off` run in eval mode; the submodules keep their mode, so dropout stays off."""
    for module in model.modules():
        if isinstance(module, GradientCheckpointingLayer):
            module.training = True


def hidden_states(trunk: Callable[..., Any], batch: Batch, packing: bool
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(hidden [N, H], rows, cols, flat [P] each): the trunk's last hidden states flattened,
    and for each predicting position (rows, cols), which predicts token cols + 1 of its row
    (every position but the last of each right-padded row), its index in `hidden`."""
    attn = batch.attention_mask
    rows, cols = attn[:, 1:].nonzero(as_tuple=True)
    if packing:
        keep = attn.bool()
        positions = (attn.cumsum(-1) - 1)[keep][None]
        hidden = trunk(input_ids=batch.input_ids[keep][None],
                       position_ids=positions, use_cache=False).last_hidden_state[0]
        lengths = attn.sum(-1)
        starts = lengths.cumsum(0) - lengths
        return hidden, rows, cols, starts[rows] + cols
    hidden = trunk(input_ids=batch.input_ids, attention_mask=attn,
                   use_cache=False).last_hidden_state
    return hidden.flatten(0, 1), rows, cols, rows * attn.size(1) + cols


def _chunk(head: nn.Module, h: torch.Tensor, ids: torch.Tensor, temperature: float,
           with_entropy: bool, top_k: int, top_p: float
           ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(logp of `ids`, entropy or None) for one chunk of hidden states `h` [C, H]:
    log softmax(head(h) / T), truncated like the sampler when top_k > 0 or top_p < 1."""
    logp_all = torch.log_softmax(head(h).float() / max(temperature, 1e-8), dim=-1)
    if top_k > 0 or top_p < 1:
        return truncated_token_logprobs(logp_all, ids, top_k, top_p, with_entropy)
    logp = logp_all.gather(-1, ids[:, None])[:, 0]
    return logp, entropy(logp_all) if with_entropy else None


def token_logprobs(
    model: nn.Module, batch: Batch, temperature: float = 1.0, with_entropy: bool = False,
    top_k: int = 0, top_p: float = 1.0, shape: PassShape = PassShape(), loss_only: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log pi(token_t | tokens_<t) [B, T] for every position (0 at t = 0 and off each row's
    length), and optionally the entropy H_t = -sum_v q_v log q_v of the distribution q that
    produced token t.

    q is softmax(logits / T), truncated like the engine's sampler when top_k > 0 or
    top_p < 1: renormalised over the set this model's own q keeps (`sampling.kept_set`) plus
    the token itself (`sampling.truncated_logprobs`), so on-policy the value is exactly the
    logprob the engine reported with `sampling.logprobs: sampled` (`train/truncation.py`).
    Packed or padded and in chunks of `shape.chunk_tokens` positions (the module docstring).

    `loss_only`: only the positions that predict a token of `batch.loss_mask` go through the
    output layer (values and entropies are 0 at every other position). The training passes
    read nothing off the mask, and there the prompt (most of an episode behind a long system
    prompt) then costs the trunk only, not the vocabulary-wide head, log-softmax and entropy
    (and their recomputation in the backward pass) at every one of its positions."""
    trunk, head = trunk_and_head(model)
    hidden, rows, cols, flat = hidden_states(trunk, batch, shape.packing)
    if loss_only:
        loss = batch.loss_mask[rows, cols + 1] > 0
        # a pass with no loss token still runs the head on one position, so that its
        # backward reaches every parameter (as the other ranks' passes do under FSDP); its
        # values are multiplied by 0 there (`real`), which keeps the graph
        keep = loss.clone()
        keep[:1] |= ~keep.any()
        real = loss[keep].float()
        rows, cols, flat = rows[keep], cols[keep], flat[keep]
    ids = batch.input_ids[rows, cols + 1]
    # one chunk: nothing to save by recomputing it
    recompute = torch.is_grad_enabled() and hidden.requires_grad and len(ids) > shape.chunk_tokens
    logps, ents = [], []
    for s in range(0, len(ids), shape.chunk_tokens):
        args = (head, hidden[flat[s : s + shape.chunk_tokens]], ids[s : s + shape.chunk_tokens],
                temperature, with_entropy, top_k, top_p)
        lp, ent = checkpoint(_chunk, *args, use_reentrant=False) if recompute else _chunk(*args)
        logps.append(lp)
        ents.append(ent)
    size, at = batch.input_ids.shape, (rows, cols + 1)
    values = [_cat(logps, hidden), _cat(ents, hidden) if with_entropy else None]
    if loss_only:
        values = [v * real.to(v.device) if v is not None else None for v in values]
    logp = hidden.new_zeros(size, dtype=torch.float32).index_put(at, values[0])
    if not with_entropy:
        return logp, None
    return logp, hidden.new_zeros(size, dtype=torch.float32).index_put(at, values[1])


def _cat(parts: list[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    """The chunks' values in order (an empty float32 tensor when there are none)."""
    return torch.cat(parts) if parts else like.new_zeros(0, dtype=torch.float32)


def entropy(logp: torch.Tensor) -> torch.Tensor:
    """H = -sum_v p_v log p_v over the last dimension of log-probabilities `logp`, with
    0 log 0 := 0: a -inf log-probability (a masked vocabulary entry) adds nothing to H or to
    its gradient (0 * -inf would be NaN in both)."""
    p = logp.exp()
    return -(p * logp.masked_fill(p == 0, 0.0)).sum(-1)
