"""The policy model (a checkpoint or a tiny one built here, its dtype, device and chat
format) and the CPU threads of the process that runs it."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from tiller.config.base import Section
from tiller.errors import ConfigError


class BuildConfig(Section):
    """A tiny Qwen3 with random weights and a BPE tokenizer trained on the env's text."""

    vocab_size: int = Field(1024, ge=300, le=65536, description="tokens of the BPE tokenizer "
                            "trained on the env's text (rows of the embedding)")
    hidden_size: int = Field(128, ge=16, le=4096, description="width of the hidden states")
    num_layers: int = Field(2, ge=1, le=64, description="transformer layers")
    num_heads: int = Field(4, ge=1, le=64, description="attention heads per layer")
    head_dim: int | None = Field(None, description="width of each attention head, even (rotary "
                                 "embeddings pair its dimensions); null = hidden_size // "
                                 "num_heads")
    corpus_tasks: int = Field(400, ge=10, description="expert episodes the tokenizer trains on")

    @field_validator("head_dim")
    @classmethod
    def _head_dim(cls, value: int | None) -> int | None:
        if value is None or (2 <= value <= 1024 and value % 2 == 0):
            return value
        raise PydanticCustomError("head_dim", "expected an even number from 2 to 1024 (rotary "
                                  "embeddings pair the dimensions of a head), or null")


class LoRAConfig(Section):
    """Low-rank adapters through peft (the lora extra): W' = W + (alpha / r) B A on each
    targeted linear layer, only A and B train (docs/trainer.md, "LoRA")."""

    r: int = Field(8, ge=1, le=4096, description="the adapters' rank")
    alpha: float = Field(16.0, gt=0, description="scale numerator: the update is "
                         "(alpha / r) B A")
    dropout: float = Field(0.0, ge=0, lt=1, description="dropout on each adapter's input "
                           "in the gradient passes; only with model.dropout: keep (under off "
                           "they run in eval mode, where it would never apply)")
    target_modules: list[str] | Literal["all-linear"] = Field(
        ["q_proj", "v_proj"], min_length=1, description="the linear layers that get adapters: "
        "module names (suffixes, as peft matches them: q_proj, v_proj for Llama, Qwen, "
        "SmolLM2) or all-linear (every linear layer but the output layer)")


class ModelConfig(Section):
    path: str | None = Field(None, description="local Hugging Face checkpoint to load: a "
                             "folder, or the name of a model `tiller models fetch` installed "
                             "(smollm2-135m-instruct; looked up in $TILLER_MODELS_DIR, else "
                             "~/.cache/tiller/models) when no such folder exists")
    build: BuildConfig | None = Field(None, description="build a tiny model instead")
    dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="engine weights and trainer compute (bf16 autocast); the "
        "trainer's master weights and optimizer stay float32")
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="where the policy, engine, reference and critic run; auto = cuda "
        "when available, else cpu")
    dropout: Literal["off", "keep"] = Field(
        "off", description="off: every gradient pass (SFT, RL, the critic) runs the model in "
        "eval mode, without dropout, so the policy trained is the one the engine samples and "
        "the ratio is 1 before an update; keep: dropout stays on in those passes (train mode). "
        "keep on a model without dropout is an error")
    chat_format: Literal["auto", "hermes", "qwen3", "qwen3.5", "llama3", "harmony"] = Field(
        "auto", description="the family whose tool-call and reasoning parser reads generated "
        "turns (rendering is always the tokenizer's own chat template); auto = detect from "
        "the template, hermes when nothing matches (docs/formats.md)")
    lora: LoRAConfig | None = Field(None, description="train low-rank adapters instead of "
                                    "every weight (the lora extra: peft); the KL reference is "
                                    "a frozen copy of the adapter at RL start (no copy of the "
                                    "base), the engine gets merged weights, checkpoints hold "
                                    "the adapter (and the reference adapter) as well "
                                    "(docs/trainer.md); null = full fine-tuning")

    @model_validator(mode="after")
    def _one_source(self) -> ModelConfig:
        if (self.path is None) == (self.build is None):
            raise ValueError("set exactly one of model.path (load) or model.build (create)")
        if self.lora is not None and self.lora.dropout > 0 and self.dropout == "off":
            raise ConfigError(f"config field model.lora.dropout: got {self.lora.dropout}; with "
                              "model.dropout: off the gradient passes run in eval mode, where "
                              "it never applies: set model.lora.dropout=0 or model.dropout=keep")
        return self


class RuntimeConfig(Section):
    """How this process uses the machine's CPUs (tiller.runtime; docs/running.md, "CPU threads")."""

    threads: int | Literal["auto"] = Field(
        "auto", description="torch's intra-op and inter-op threads in this process, and "
        "OMP/MKL/OpenBLAS/Rayon threads for the processes it starts; set once when the model "
        "is loaded, recorded in runtime.json. auto: OMP_NUM_THREADS when the environment sets "
        "it, else the cores no other process is using (usable cores minus the 1-minute load "
        "average, rounded) shared among the torch compute streams that run at once (the "
        "embedded engine, a judge model, and the trainer outside rl.mode sync), and 1 for a "
        "model under 250,000 parameters")

    @field_validator("threads", mode="before")
    @classmethod
    def _threads(cls, value: Any) -> int | str:
        whole = isinstance(value, int) and not isinstance(value, bool)
        if value == "auto" or (whole and value >= 1):
            return value
        raise PydanticCustomError("threads", "expected auto or a whole number of threads, at "
                                  "least 1")
