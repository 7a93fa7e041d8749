"""How the trainer's passes use memory: sequence packing, micro-batches by token budget,
log-probabilities in chunks and activation checkpointing (docs/trainer.md)."""

from __future__ import annotations

from pydantic import Field

from tiller.config.base import Section


class TrainConfig(Section):
    """Memory and speed of every forward/backward pass (SFT, RL, the reference model and the
    critic); none of these changes a loss or its normalizers."""

    packing: bool = Field(
        False, description="concatenate a micro-batch's sequences into one row with position "
        "ids restarting per sequence (attention stays within each sequence): no padding token "
        "reaches the model; logprobs equal the padded pass's to float rounding")
    micro_batch_tokens: int | None = Field(
        None, ge=1, description="also close a micro-batch before it exceeds this many tokens "
        "(packed: the sum of its lengths; padded: rows x its longest row); null = rows only "
        "(rl.micro_batch_size, sft.micro_batch_size still cap the rows). A longer sequence "
        "runs alone")
    logprob_chunk_tokens: int = Field(
        256, ge=1, description="positions whose [positions, vocab] logits and log-softmax "
        "exist at once; the output layer and log-softmax run chunk by chunk and are recomputed "
        "in the backward pass, so the full [tokens, vocab] matrix never exists")
    activation_checkpointing: bool = Field(
        False, description="keep only each transformer layer's input in the gradient passes "
        "and recompute the layer in the backward pass: less memory, about one more forward")
