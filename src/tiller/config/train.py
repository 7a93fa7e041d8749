"""The trainer: its ranks over torch.distributed (docs/scaling.md) and how its passes use
memory: sequence packing, micro-batches by token budget, log-probabilities in chunks and
activation checkpointing (docs/trainer.md)."""

from __future__ import annotations

from pydantic import Field

from tiller.config.base import Section


class TrainConfig(Section):
    """The trainer group (how many ranks train the policy over torch.distributed) and the
    memory and speed of every forward/backward pass (SFT, RL, the reference model and the
    critic), on every rank alike; none of these changes a loss or its normalizers."""

    world_size: int = Field(1, ge=1, description="trainer ranks: 1 trains in the run's own "
                            "process; N > 1 shards the policy over N ranks with FSDP2 "
                            "(torch.distributed.fsdp.fully_shard, gloo: CPU only, "
                            "model.device cpu; NCCL is not built), "
                            "each optimizer batch split across them by tokens with global loss "
                            "normalizers and global gradient clipping (docs/scaling.md); the KL "
                            "reference model and the critic are sharded the same way; under "
                            "model.lora every rank holds the frozen base and the adapters, "
                            "their gradients summed over the ranks; every rank uses the "
                            "train.* options below")
    rank_timeout_s: float = Field(600.0, gt=0, description="the longest any collective between "
                                  "trainer ranks may wait (a rank that died fails the run "
                                  "naming it); only with train.world_size > 1")

    packing: bool = Field(
        False, description="concatenate a micro-batch's sequences into one row with position "
        "ids restarting per sequence (attention stays within each sequence): no padding token "
        "reaches the model; logprobs equal the padded pass's to float rounding")
    micro_batch_tokens: int | None = Field(
        None, ge=1, description="also close a micro-batch before it exceeds this many tokens "
        "(packed: the sum of its lengths; padded: rows x its longest row); null = rows only "
        "(rl.micro_batch_size, sft.micro_batch_size still cap the rows). A longer sequence "
        "runs alone. With train.world_size > 1 each rank cuts its share of the rows this way "
        "and all run as many passes as the rank that needs the most")
    logprob_chunk_tokens: int = Field(
        256, ge=1, description="positions whose [positions, vocab] logits and log-softmax "
        "exist at once; the output layer and log-softmax run chunk by chunk and are recomputed "
        "in the backward pass, so the full [tokens, vocab] matrix never exists")
    activation_checkpointing: bool = Field(
        False, description="keep only each transformer layer's input in the gradient passes "
        "and recompute the layer in the backward pass: less memory, about one more forward")
