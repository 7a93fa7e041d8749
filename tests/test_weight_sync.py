"""Weight sync (tiller.engine.weight_sync): delta equals full bit for bit, the index encoding,
auto's choice by exact byte counts, corrupted syncs caught (checksum and parity), unresponsive
engines timing out with an error naming what was waited for, and deltas over HTTP through real
`tiller serve` subprocesses."""

from __future__ import annotations

import copy
import pickle
import re
import socket
import threading
import time

import httpx
import numpy as np
import pytest
import torch
from test_http_engine import servers

from tiller.config import WeightSyncConfig, load_config
from tiller.engine.delta import DeltaUpdate, TensorDelta, bits, decode_gaps, encode_gaps
from tiller.engine.embedded import EmbeddedEngine
from tiller.engine.http import HttpEngine
from tiller.engine.updates import WeightSyncError, WeightUpdate, checksum_positions, checksums
from tiller.engine.weight_sync import WeightSync
from tiller.errors import ConfigError, RunError
from tiller.train.trainer import PolicyTrainer


def engine_of(model, dtype=torch.bfloat16) -> EmbeddedEngine:
    return EmbeddedEngine(copy.deepcopy(model).to(dtype), 0)


def syncer(model, engine, dtype=torch.bfloat16, **cfg) -> WeightSync:
    return WeightSync(PolicyTrainer(model), engine, WeightSyncConfig(**cfg), dtype)


def step(sync: WeightSync) -> None:
    """What an optimizer step does to the sender: a new version."""
    sync.trainer.version += 1


def same_bits(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(bits(sa[k]), bits(sb[k])) for k in sa)


# ---------------------------------------------------------------- the index encoding
@pytest.mark.parametrize("indices", [
    [], [0], [5], list(range(1000)), [0, 127, 128, 16511, 2**40, 2**40 + 1, 2**62],
    sorted(np.random.default_rng(0).choice(10**7, 5000, replace=False).tolist()),
])
def test_gap_encoding_round_trips(indices):
    idx = np.array(indices, dtype=np.int64)
    data = encode_gaps(idx)
    assert data.dtype == np.uint8
    assert decode_gaps(data).tolist() == indices
    gaps = np.diff(idx, prepend=0)
    # LEB128: 7 bits a byte, so a gap costs max(1, ceil(bit_length / 7)) bytes
    assert data.size == sum(max(1, -(-int(g).bit_length() // 7)) for g in gaps)


def test_all_changed_costs_one_byte_per_index_and_a_cut_varint_is_refused():
    assert encode_gaps(np.arange(300)).size == 300
    with pytest.raises(ValueError, match="end inside a varint"):
        decode_gaps(encode_gaps(np.array([2**20]))[:-1])


# ---------------------------------------------------------------- delta == full
def perturb(model, rng: np.random.Generator) -> str:
    """One random update of the trainer's fp32 weights; returns what kind it was."""
    kind = rng.choice(["sparse", "tiny", "dense", "none"], p=[0.5, 0.2, 0.2, 0.1])
    with torch.no_grad():
        for p in model.parameters():
            if kind == "none":
                continue
            if kind == "dense":
                p.add_(1e-2 * torch.randn_like(p))
                continue
            mask = torch.rand_like(p) < rng.uniform(0.001, 0.05)
            # "tiny" changes round away in bf16 (relative 1e-5, far below bf16's 2^-8)
            scale = 1e-5 if kind == "tiny" else float(10 ** rng.uniform(-4, -1))
            p.add_(mask * scale * p.abs().clamp_min(1e-3) * torch.randn_like(p))
    return str(kind)


def test_delta_equals_full_bit_for_bit_after_50_random_updates(model):
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    by_delta, by_full = engine_of(model), engine_of(model)
    delta = syncer(model, by_delta, mode="delta")
    full = WeightSync(delta.trainer, by_full, WeightSyncConfig(mode="full"), torch.bfloat16)
    kinds, changed = [], []
    try:
        for _ in range(50):
            kinds.append(perturb(model, rng))
            step(delta)
            m = delta.push()
            full.push()
            changed.append(m["sync/changed_frac"])
            assert m["sync/kind"] == (0.0 if len(changed) == 1 else 1.0)
        assert by_delta.version == by_full.version == 50
        assert same_bits(by_delta.model, by_full.model)
        assert same_bits(by_delta.model, copy.deepcopy(model).to(torch.bfloat16))
        # the draw covered each kind, and updates that round away changed (almost) nothing
        assert set(kinds) == {"sparse", "tiny", "dense", "none"}
        nothing = [c for k, c in zip(kinds[1:], changed[1:], strict=True) if k == "none"]
        assert nothing and max(nothing) == 0.0
        assert max(c for k, c in zip(kinds[1:], changed[1:], strict=True) if k == "tiny") < 0.01
    finally:
        by_delta.close()
        by_full.close()


def test_negative_zero_and_nan_are_shipped_by_bit_pattern(model):
    engine = engine_of(model, torch.float32)
    sync = syncer(model, engine, torch.float32, mode="delta")
    try:
        sync.push()
        norm = next(n for n, p in model.named_parameters() if "norm" in n)
        with torch.no_grad():
            dict(model.named_parameters())[norm][:2] = torch.tensor([0.0, -0.0])
        step(sync)
        sync.push(in_flight="abort")  # passed on to the engine
        with torch.no_grad():
            dict(model.named_parameters())[norm][0] = -0.0  # == 0.0, but another bit pattern
        step(sync)
        update, m = sync.build(sync.trainer.version)
        assert isinstance(update, DeltaUpdate) and m["sync/bytes"] == 1 + 4  # one gap, one fp32
        assert update.deltas[norm].values.numel() == 1
        assert torch.signbit(update.deltas[norm].values[0])
    finally:
        engine.close()


# ---------------------------------------------------------------- auto
def expected_delta_bytes(old: dict, new: dict, itemsize: int) -> int:
    """Delta bytes counted independently of the encoder: per changed element its value, plus
    each index gap's LEB128 length."""
    total = 0
    for k in old:
        idx = torch.nonzero(bits(old[k]).reshape(-1) != bits(new[k]).reshape(-1))[:, 0]
        gaps = np.diff(idx.numpy(), prepend=0)
        total += idx.numel() * itemsize + sum(max(1, -(-int(g).bit_length() // 7))
                                              for g in gaps)
    return total


@pytest.mark.parametrize("dense", [False, True])
def test_auto_ships_the_fewer_bytes_by_exact_count(model, dense, caplog):
    engine = engine_of(model)
    sync = syncer(model, engine, mode="auto")
    try:
        sync.push()
        before = {k: v.clone() for k, v in sync.synced.items()}
        torch.manual_seed(1)
        with torch.no_grad():
            for p in model.parameters():
                mask = torch.ones_like(p) if dense else (torch.rand_like(p) < 0.01)
                p.add_(mask * 0.05 * torch.randn_like(p))
        step(sync)
        after = {k: t.detach().to(torch.bfloat16) for k, t in sync._live().items()}
        want_delta = expected_delta_bytes(before, after, 2)
        full = sum(t.numel() for t in after.values()) * 2
        with caplog.at_level("INFO", logger="tiller.engine.weight_sync"):
            m = sync.push()
        assert m["sync/full_bytes"] == full
        assert m["sync/bytes"] == min(want_delta, full)
        assert m["sync/kind"] == (0.0 if dense else 1.0)
        assert want_delta > full if dense else want_delta < 0.05 * full
        assert f"weight sync v1: {'full' if dense else 'delta'}" in caplog.text
        assert same_bits(engine.model, copy.deepcopy(model).to(torch.bfloat16))
    finally:
        engine.close()


# ---------------------------------------------------------------- corrupted syncs
@pytest.mark.parametrize("mode", ["full", "delta"])
def test_an_update_tampered_after_its_checksum_is_refused_naming_version_and_tensor(model,
                                                                                   mode):
    engine = engine_of(model)
    sync = syncer(model, engine, mode=mode)
    try:
        sync.push()
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.01 * torch.randn_like(p))
        step(sync)
        update, _ = sync.build(1)
        name = "model.layers.0.mlp.up_proj.weight"
        if mode == "full":
            update.tensors[name] = update.tensors[name] + 1.0
        else:
            update.deltas[name].values.add_(1.0)
        before = copy.deepcopy(engine.model)
        with pytest.raises(WeightSyncError, match=f"weight update v1: tensor {name} would not "
                                                  "hold what was sent .* nothing was applied"):
            engine.update_weights(update)
        # refused before writing: not one weight changed, and the version did not move
        assert engine.version == 0 and same_bits(engine.model, before)
    finally:
        engine.close()


# ---------------------------------------------------------------- malformed updates
GOOD, BAD = "model.layers.0.mlp.up_proj.weight", "model.layers.1.mlp.down_proj.weight"


def leb128(gaps: list[int]) -> torch.Tensor:
    """Varints of arbitrary gaps (encode_gaps takes only ascending positions)."""
    out = []
    for g in gaps:
        while True:
            out.append((g & 0x7F) | (0x80 if g >> 7 else 0))
            g >>= 7
            if not g:
                break
    return torch.tensor(out, dtype=torch.uint8)


def bad_deltas(n: int, dtype: torch.dtype) -> dict[str, tuple[dict, str]]:
    """Per case: the bad tensor's entries of a delta (its name -> TensorDelta) and what the
    one-line error says about it; n is the tensor's size."""
    two = torch.ones(2, dtype=dtype)
    return {
        # positions n + 3 then (wrapping) 1: only the last position was bounds-checked before
        "wrapped": ({BAD: TensorDelta(n, leb128([n + 3, 2**64 - n - 2]), two)},
                    rf"positions not strictly ascending inside \[0, {n}\)"),
        "past the end": ({BAD: TensorDelta(n, torch.from_numpy(encode_gaps(np.array([0, n]))),
                                           two)}, "positions not strictly ascending"),
        "count": ({BAD: TensorDelta(n, torch.from_numpy(encode_gaps(np.arange(3))), two)},
                  "3 positions for 2 values"),
        "cut varint": ({BAD: TensorDelta(n, torch.tensor([0x85], dtype=torch.uint8), two[:1])},
                       "end inside a varint"),
        "dtype": ({BAD: TensorDelta(n, leb128([0]), torch.ones(1, dtype=torch.float64))},
                  f"values in torch.float64 for the model's {dtype} \\(a delta is never cast"),
        "size": ({BAD: TensorDelta(n + 1, leb128([0]), two[:1])},
                 f"{n + 1} elements vs the model's {n}"),
        "name": ({"no.such.tensor": TensorDelta(n, leb128([0]), two[:1])},
                 "no.such.tensor \\(the model has no such tensor"),
    }


@pytest.mark.parametrize("case", list(bad_deltas(1, torch.float32)))
def test_a_malformed_delta_is_refused_whole_and_changes_no_weight(model, case):
    """A delta whose first tensor is fine and whose second is malformed: one WeightSyncError
    naming the bad tensor, raised before the first is written (every weight bit-identical,
    the version unchanged), and a good delta applies afterwards."""
    engine = engine_of(model)
    try:
        own = engine.model.state_dict()
        good = TensorDelta(own[GOOD].numel(), leb128([0, 5, 7]),
                           torch.full((3,), 7.0, dtype=own[GOOD].dtype))
        tensors, words = bad_deltas(own[BAD].numel(), own[BAD].dtype)[case]
        before = copy.deepcopy(engine.model)
        with pytest.raises(WeightSyncError) as e:
            engine.update_weights(DeltaUpdate(1, 0, {GOOD: good, **tensors}))
        message = str(e.value)
        assert message.startswith("delta update v1 does not fit the model: ")
        assert "\n" not in message
        assert re.search(words, message) and GOOD not in message, message
        assert engine.version == 0 and same_bits(engine.model, before)
        assert engine.update_weights(DeltaUpdate(1, 0, {GOOD: good})) == 1
        assert own[GOOD].view(-1)[[0, 5, 12]].tolist() == [7.0, 7.0, 7.0]
    finally:
        engine.close()


@pytest.mark.parametrize("case, words", [
    ("dtype", r"dtype mismatch \(only floating point is cast\): "
              rf"{BAD} torch.int64 vs the model's torch.bfloat16"),
    ("not a tensor", f"not tensors: {BAD}"),
    ("shape", f"shape mismatch: {BAD}"),
    ("name", "tensors the model lacks: no.such.tensor")])
def test_a_full_update_with_one_bad_tensor_changes_no_weight(model, case, words):
    """Every other tensor of the update is new and fine: none of them is written."""
    engine = engine_of(model)
    try:
        tensors = {k: v + 1.0 for k, v in model.state_dict().items()}
        target = tensors[BAD]
        tensors[BAD] = {"dtype": target.long(), "not a tensor": target.tolist(),
                        "shape": target[:-1], "name": target}[case]
        if case == "name":
            tensors["no.such.tensor"] = target
        before = copy.deepcopy(engine.model)
        with pytest.raises(WeightSyncError) as e:
            engine.update_weights(WeightUpdate(1, tensors))
        assert str(e.value).startswith("weight update v1 does not fit the model: ")
        assert re.search(words, str(e.value)) and "\n" not in str(e.value)
        assert engine.version == 0 and same_bits(engine.model, before)
    finally:
        engine.close()


def test_engine_weights_corrupted_where_the_checksum_does_not_look_fail_the_parity_check(model):
    engine = engine_of(model)
    sync = syncer(model, engine, mode="delta", parity_tol=0.05)
    try:
        first = sync.push()
        assert first["sync/parity_mean_abs"] < 0.01
        # behind the sync's back: the embedding rows of the probe's tokens, except the
        # positions the checksum samples
        emb = engine.model.get_input_embeddings().weight
        mask = torch.zeros(emb.numel(), dtype=torch.bool)
        rows = torch.tensor(sorted(set(sync.probe)))
        mask.view(emb.shape)[rows] = True
        mask[checksum_positions(emb.numel(), emb.device)] = False
        with torch.no_grad():
            emb.view(-1)[mask] = 3.0
        step(sync)
        with pytest.raises(WeightSyncError, match=r"weight sync v1: parity check failed on the "
                                                  r"embedded engine: mean \|logprob difference\| "
                                                  r"to the trainer [\d.]+ > weight_sync."
                                                  r"parity_tol 0.05"):
            sync.push()  # the checksum passed: it does not sample those positions
        assert engine.version == 1
        assert sync.base is None  # so the next sync is a full one, which repairs the engine
        step(sync)
        assert sync.push()["sync/kind"] == 0.0
    finally:
        engine.close()


# ---------------------------------------------------------------- timeouts
def test_a_push_to_an_engine_stuck_in_a_forward_times_out_naming_the_update(model, tokenizer):
    from tiller.engine.api import SamplingParams

    engine = engine_of(model)
    entered, release = threading.Event(), threading.Event()

    def block(*_):
        entered.set()
        release.wait(60)

    handle = engine.model.register_forward_hook(block)
    try:
        engine.submit(tokenizer.encode("1 + 1 ="), SamplingParams(
            max_new_tokens=2, stop_token_ids=(tokenizer.eos_token_id,)), 0)
        assert entered.wait(30)
        sync = syncer(model, engine, mode="auto", timeout_s=1.0)
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match=r"embedded engine: weight update v0 was not "
                                               r"applied within 1s"):
            sync.push()
        assert time.monotonic() - t0 < 5
        assert sync.base is None
    finally:
        release.set()
        handle.remove()
        engine.close()


def test_a_push_to_a_server_that_never_answers_times_out_naming_it(model, tmp_path):
    listener = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []
    done = threading.Event()

    def accept() -> None:  # accepts and never answers
        listener.settimeout(0.2)
        while not done.is_set():
            try:
                held.append(listener.accept()[0])
            except TimeoutError:
                continue

    acceptor = threading.Thread(target=accept, daemon=True)
    acceptor.start()
    url = f"http://127.0.0.1:{listener.getsockname()[1]}"
    http = HttpEngine([url], weights_dir=tmp_path / "w", request_timeout_s=120)
    try:
        sync = syncer(model, http, torch.float32, timeout_s=1.0)
        t0 = time.monotonic()
        with pytest.raises(RunError, match=rf"{url}: weight update v0: "
                                           r"/update_weights_from_disk: no answer within 1 s"):
            sync.push()
        assert time.monotonic() - t0 < 10
    finally:
        http.close()
        done.set()
        acceptor.join(5)
        for c in held:
            c.close()
        listener.close()


# ---------------------------------------------------------------- over HTTP
@pytest.mark.slow
@pytest.mark.integration  # a live `tiller serve` (test_http_engine.servers)
def test_deltas_over_http_reach_tiller_serve_and_another_base_is_refused(model, calc_model_dir,
                                                                        tmp_path):
    with servers(calc_model_dir, 1, tmp_path / "root") as s:
        http = HttpEngine(s.urls, weights_dir=s.root / "w", request_timeout_s=60)
        try:
            sync = syncer(model, http, torch.float32, mode="delta", timeout_s=60)
            assert sync.push()["sync/kind"] == 0.0  # the first sync is full
            torch.manual_seed(2)
            for _ in range(2):
                with torch.no_grad():
                    for p in model.parameters():
                        p.add_((torch.rand_like(p) < 0.02) * 0.05 * torch.randn_like(p))
                step(sync)
                m = sync.push()
                assert m["sync/kind"] == 1.0 and m["sync/bytes"] < 0.2 * m["sync/full_bytes"]
                # the server's own forward agrees with the trainer's (both fp32)
                assert m["sync/parity_max_abs"] < 1e-4
            meta = (http.weights_dir / "v2" / "tiller_version.json").read_text()
            assert '"kind": "delta"' in meta and '"base_version": 1' in meta
            stale = DeltaUpdate(3, 1, {}, {})
            with pytest.raises(RunError, match="delta update v3 is against base version v1, "
                                               "but this server holds v2"):
                http.update_weights(stale)
            # a delta whose checksum the server cannot match: a 400 naming the tensor
            step(sync)
            with torch.no_grad():
                next(model.parameters()).add_(0.01)
            update, _ = sync.build(3)
            name = next(iter(update.checksums))
            update.checksums[name] += 1.0
            held = http.score(sync.probe)
            with pytest.raises(RunError, match=r"HTTP 400: .*refused .*nothing was applied"):
                http.update_weights(update)
            assert http.score(sync.probe) == held  # refused before writing: still v2, exactly
        finally:
            http.close()


@pytest.mark.slow
@pytest.mark.integration  # a live `tiller serve` (test_http_engine.servers)
def test_a_version_folder_a_killed_run_left_is_written_again_from_empty(model, calc_model_dir,
                                                                       tmp_path, caplog):
    """Issue 24: a run killed after it pushed version 2 as a delta (and checkpointed it) left
    weights/v2 holding delta.safetensors; the resumed run's engine pushes the checkpoint's
    version 2 again, full, into that folder. The folder is emptied first, so the server reads
    only the full update's files (before, it read the delta's `<name>/idx` tensors too and
    refused the update: "tensors the model lacks"), and the warning names what was removed."""
    with servers(calc_model_dir, 1, tmp_path / "root") as s:
        killed = HttpEngine(s.urls, weights_dir=s.root / "w", request_timeout_s=60)
        try:
            sync = syncer(model, killed, torch.float32, mode="delta", timeout_s=60)
            step(sync)
            sync.push()  # v1, full
            torch.manual_seed(2)
            with torch.no_grad():
                for p in model.parameters():
                    p.add_((torch.rand_like(p) < 0.02) * 0.05 * torch.randn_like(p))
            step(sync)
            assert sync.push()["sync/kind"] == 1.0  # v2, a delta
        finally:
            killed.close()
        folder = s.root / "w" / "v2"
        assert sorted(p.name for p in folder.iterdir()) == ["delta.safetensors",
                                                            "tiller_version.json"]
        resumed = HttpEngine(s.urls, weights_dir=s.root / "w", request_timeout_s=60)
        try:
            trainer = PolicyTrainer(model)
            trainer.version = 2  # the checkpoint's
            again = WeightSync(trainer, resumed, WeightSyncConfig(timeout_s=60), torch.float32)
            m = again.push()
            assert m["sync/kind"] == 0.0 and m["sync/parity_max_abs"] < 1e-4
            assert resumed.version == 2
            assert sorted(p.name for p in folder.iterdir()) == ["model.safetensors",
                                                                "tiller_version.json"]
        finally:
            resumed.close()
    removed = [r.getMessage() for r in caplog.records if "this engine did not write" in
               r.getMessage()]
    assert removed == [f"weight push v2: {folder.resolve()} holds files this engine did not "
                       f"write (delta.safetensors, tiller_version.json: a killed run's?); "
                       f"removed before the version is written"], removed


@pytest.mark.slow
@pytest.mark.integration  # a live `tiller serve` (test_http_engine.servers)
def test_tiller_serve_refuses_a_malformed_update_whole(model, calc_model_dir, tmp_path):
    """Through a live `tiller serve` (float32): a delta whose first tensor is fine and whose
    second has a position past its end, and a full checkpoint with every tensor new but one of
    the wrong dtype, are each a 400 naming the bad tensor. The server's weights score a probe
    bit for bit as before, its version stays, and a good update applies afterwards."""
    with servers(calc_model_dir, 1, tmp_path / "root") as s:
        http = HttpEngine(s.urls, weights_dir=s.root / "w", request_timeout_s=60)
        try:
            probe = list(range(3, 60))
            before = http.score(probe)
            own = model.state_dict()
            n = own[BAD].numel()
            good = TensorDelta(own[GOOD].numel(), leb128([0, 5, 7]), torch.full((3,), 7.0))
            wrapped = TensorDelta(n, leb128([n + 3, 2**64 - n - 2]), torch.ones(2))
            full = {k: v + 1.0 for k, v in own.items()}
            full[BAD] = full[BAD].long()
            for folder, update, words in (
                    ("bad_delta", DeltaUpdate(1, 0, {GOOD: good, BAD: wrapped}),
                     rf"delta update v1 does not fit the model: {BAD} \(positions not strictly "
                     rf"ascending inside \[0, {n}\)\)"),
                    ("bad_full", WeightUpdate(1, full),
                     r"weight update v1 does not fit the model: dtype mismatch \(only floating "
                     rf"point is cast\): {BAD} torch.int64 vs the model's torch.float32")):
                update.save(s.root / folder)
                r = httpx.post(s.urls[0] + "/update_weights_from_disk", timeout=60,
                               json={"model_path": folder, "weight_version": 1})
                assert http.score(probe) == before  # every logprob bit for bit
                info = httpx.get(s.urls[0] + "/get_model_info", timeout=30).json()
                assert info["weight_version"] == 0
                message = r.json()["error"]["message"]
                assert r.status_code == 400 and re.search(words + "$", message), message
            assert http.update_weights(DeltaUpdate(1, 0, {GOOD: good})) == 1
            assert http.score(probe) != before
        finally:
            http.close()


# ---------------------------------------------------------------- config and scoring
def test_weight_sync_config_is_validated():
    with pytest.raises(ConfigError, match="config field weight_sync.mode"):
        load_config(None, ["model.path=x", "weight_sync.mode=sometimes"])
    with pytest.raises(ConfigError, match="config field weight_sync.parity_tokens"):
        load_config(None, ["model.path=x", "weight_sync.parity_tokens=1"])
    cfg = load_config(None, ["model.path=x", "weight_sync.timeout_s=5"])
    assert cfg.weight_sync.timeout_s == 5.0 and cfg.weight_sync.mode is None


def test_a_probe_longer_than_the_context_is_a_config_error(model):
    engine = engine_of(model)
    try:
        context = model.config.max_position_embeddings
        assert context < 4096
        with pytest.raises(ConfigError, match=f"weight_sync.parity_tokens: got 4096; expected "
                                              f"at most the model's context of {context}"):
            WeightSync(PolicyTrainer(model), engine, WeightSyncConfig(parity_tokens=4096),
                       torch.bfloat16)
    finally:
        engine.close()


def test_trainer_and_engine_score_alike_in_fp32(model):
    engine = engine_of(model, torch.float32)
    try:
        ids = list(range(3, 40))
        got, want = engine.score(ids), PolicyTrainer(model).score(ids)
        assert len(got) == len(want) == len(ids) - 1
        assert np.allclose(got, want, atol=1e-5)
        assert all(lp < 0 for lp in want)
    finally:
        engine.close()


def test_a_sync_whose_sender_scrambled_a_tensor_is_caught_by_the_parity_check(model):
    """A sender bug (embedding rows in the wrong order, as a wrong shard order would give)
    whose checksums describe what it sent: the receiver's checksum passes, parity does not."""
    engine = engine_of(model)
    sync = syncer(model, engine, mode="full")
    try:
        sync.push()
        step(sync)
        update, _ = sync.build(1)
        emb = model.get_input_embeddings().weight
        perm = torch.randperm(emb.size(0), generator=torch.Generator().manual_seed(0))
        scrambled = update.tensors["model.embed_tokens.weight"][perm]
        tensors = {k: scrambled if v.data_ptr() == emb.data_ptr() else v
                   for k, v in update.tensors.items()}  # tied lm_head gets it too
        unique = {k: tensors[k] for k in dict.fromkeys(sync.aliases.values())}
        bad = WeightUpdate(1, tensors, checksums=checksums(unique, torch.bfloat16))
        assert engine.update_weights(bad) == 1  # the checksums match what was sent
        with pytest.raises(WeightSyncError, match=r"weight sync v1: parity check failed on the "
                                                  r"embedded engine"):
            sync.check_parity(1)
    finally:
        engine.close()


def test_integer_buffers_reach_the_engine_exactly_by_delta(model):
    """Only floating tensors take the engine's dtype: an int64 buffer through bf16 would
    round 1000001 to 999424."""
    model = copy.deepcopy(model)
    model.register_buffer("counts", torch.tensor([257, 1000001]))
    engine = engine_of(model)
    sync = syncer(model, engine, mode="delta")
    try:
        sync.push()
        model.counts += torch.tensor([1, 2])
        step(sync)
        assert sync.push()["sync/kind"] == 1.0
        assert engine.model.counts.tolist() == [258, 1000003]
        assert engine.model.counts.dtype == torch.int64
    finally:
        engine.close()


def test_a_control_call_stuck_inside_a_forward_times_out_instead_of_hanging(model):
    engine = engine_of(model)
    release = threading.Event()
    handle = engine.model.register_forward_hook(lambda *_: release.wait(60))
    try:
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match=r"embedded engine: .* started but did not "
                                               r"finish within 2s"):
            engine.score([1, 2, 3, 4], timeout_s=1.0)
        assert time.monotonic() - t0 < 10
    finally:
        release.set()
        handle.remove()
        engine.close()


def test_the_default_mode_is_full_in_memory(model):
    engine = engine_of(model)
    try:
        sync = syncer(model, engine)
        assert sync.mode == "full"
        step(sync)
        assert sync.push()["sync/kind"] == 0.0  # and stays full at every sync
        step(sync)
        assert sync.push()["sync/kind"] == 0.0
    finally:
        engine.close()


@pytest.mark.parametrize("engine_dtype", [torch.bfloat16, torch.float32])
def test_a_full_update_to_ray_workers_ships_what_sync_bytes_counts(model, engine_dtype):
    """Under cluster.backend ray the full update is pickled into Ray's object store for the
    rollout workers: it holds the engine-dtype tensors, so its pickled size is sync/bytes (plus
    the pickle's names and headers), not the fp32 master weights' (2x under bf16 before)."""
    from tiller.rollout.ray_rollouts import RayWorkers

    sync = WeightSync(PolicyTrainer(model), RayWorkers.__new__(RayWorkers),
                      WeightSyncConfig(), engine_dtype)
    update, m = sync.build(1)
    shipped = len(pickle.dumps(update, protocol=5))
    assert m["sync/bytes"] == m["sync/full_bytes"] == sum(
        t.nbytes for t in {t.data_ptr(): t for t in update.tensors.values()}.values())
    assert m["sync/bytes"] < shipped < 1.05 * m["sync/bytes"], (shipped, m)
