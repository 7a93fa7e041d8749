"""What a resumable checkpoint costs: its size, the time to write it (files, SHA-256 marker,
fsyncs, rename) and the time to verify and read it back, for the demo's model and for a
randomly initialised Llama of SmolLM2-135M's shape (docs/resume.md).

    .venv/bin/python benchmarks/checkpoint_cost.py [--out DIR] [--repeats 3]

Each model gets an AdamW optimizer that has taken one step (so it holds both moments, as
every checkpoint after the first RL step does), then `tiller.checkpoints.write_checkpoint`
writes the parts `save_rl` writes: the model folder (safetensors, fp32 master weights),
trainer.pt (the optimizer's state), rng.pt and a state.json. The rollout state in a real
state.json is a few KB more (the task ids drawn so far). Reading back is `verify` (hashing
every file) plus `load_weights` and the optimizer's `load_state_dict`, of the checkpoint just
written: its files are in the page cache (hot), so the read-back time leaves out the disk's.
When SmolLM2-135M-Instruct is fetched (in `tiller.models.models_dir()`: $TILLER_MODELS_DIR,
else ~/.cache/tiller/models) it is measured as well, and a last row times `model_fingerprint`
over it; when it is not, a line on stderr says both rows are skipped.

With `--ranks N` (N > 1) each model is measured once more on N trainer ranks (FSDP2 over
gloo, `train.ranks.start_ranks`, spawned processes) after one SFT step on random tokens:
writing includes the gather of every rank's optimizer shard and RNG states to rank 0
(`Leader.checkpoint_state`, also timed alone as `gather_s_median`), reading back includes
handing them to the ranks again (`Leader.load_checkpoint_state`).

    .venv/bin/python benchmarks/checkpoint_cost.py --ranks 2
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

import torch  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from tiller.checkpoints import (  # noqa: E402
    Checkpoint,
    complete_checkpoints,
    load_tensors,
    load_weights,
    model_fingerprint,
    verify,
    write_checkpoint,
)
from tiller.config import load_config  # noqa: E402
from tiller.models import build_env_model, load_model, load_tokenizer, models_dir  # noqa: E402
from tiller.plugins import load_env_class  # noqa: E402
from tiller.train.batch import Batch  # noqa: E402
from tiller.train.distributed import TrainerOptions  # noqa: E402
from tiller.train.process_state import add_rank_states, rank_states, rng_state  # noqa: E402
from tiller.train.ranks import start_ranks  # noqa: E402

SMOLLM2_NAME = "smollm2-135m-instruct"  # in models_dir() once `tiller fetch`ed
SMOLLM2_135M = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                    num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                    head_dim=64, tie_word_embeddings=True, max_position_embeddings=8192)


def demo_model(folder: Path) -> tuple[torch.nn.Module, object]:
    cfg = load_config(ROOT / "configs" / "calculator.yaml")
    env = load_env_class(cfg.env.name)
    path = build_env_model(env, folder / "base_model", cfg.model.build, seed=cfg.seed,
                           difficulty=cfg.env.difficulty, max_turns=cfg.env.max_turns,
                           tools=[], root=folder)
    return load_model(path, torch.float32), load_tokenizer(path)


def llama_135m() -> tuple[torch.nn.Module, None]:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**SMOLLM2_135M)).float(), None


def stepped_optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    for p in model.parameters():
        p.grad = torch.full_like(p, 1e-3)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return opt


def timed_round_trips(run_dir: Path, repeats: int, parts: Callable[[Path], dict],
                      load: Callable[[Checkpoint], None]
                      ) -> tuple[list[float], list[float], Checkpoint]:
    """`repeats` checkpoints written with `parts` (timed), each verified and read back with
    `load` (timed); the write and read seconds and the last checkpoint."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text("{}\n")
    writes, reads = [], []
    for i in range(repeats):
        t0 = time.perf_counter()
        write_checkpoint(run_dir, i + 1, 1, parts)
        writes.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        ckpt = verify(complete_checkpoints(run_dir)[0], keys=("step",))
        load(ckpt)
        reads.append(time.perf_counter() - t0)
    return writes, reads, ckpt


def measure(name: str, model: torch.nn.Module, tokenizer: object, run_dir: Path,
            repeats: int) -> dict[str, float | str]:
    opt = stepped_optimizer(model)

    def parts(new: Path) -> dict:
        step = int(new.name.removeprefix("step-"))
        model.save_pretrained(new / "model", safe_serialization=True, max_shard_size="1000GB")
        if tokenizer is not None:
            tokenizer.save_pretrained(new / "model")
        torch.save({"optimizer": opt.state_dict()}, new / "trainer.pt")
        py, tensors = rng_state()
        torch.save(tensors, new / "rng.pt")
        return {"step": step, "rng": py}

    def load(ckpt: Checkpoint) -> None:
        load_weights(model, ckpt)
        opt.load_state_dict(load_tensors(ckpt.path / "trainer.pt")["optimizer"])

    writes, reads, ckpt = timed_round_trips(run_dir, repeats, parts, load)
    params = sum(p.numel() for p in model.parameters())
    return {"model": name, "params_M": round(params / 1e6, 2),
            "size_MiB": round(ckpt.size / 2**20, 1),
            "write_s_median": round(sorted(writes)[len(writes) // 2], 2),
            "read_s_median": round(sorted(reads)[len(reads) // 2], 2)}


def measure_ranks(name: str, model: torch.nn.Module, tokenizer: object, run_dir: Path,
                  repeats: int, world: int) -> dict[str, float | str]:
    """`measure` on `world` trainer ranks: what `resume.save_rl` and `restore_rl` do with
    them, after one SFT step (both AdamW moments in every rank's shard)."""
    leader = start_ranks(model, world, TrainerOptions(), "local", 600.0)
    try:
        leader.set_optimizer(1e-5)
        torch.manual_seed(0)
        ids = torch.randint(0, model.config.vocab_size, (2 * world, 64))
        ones = torch.ones(ids.shape)
        leader.sft_step(Batch(input_ids=ids, attention_mask=torch.ones_like(ids),
                              loss_mask=ones, rollout_logprobs=torch.zeros(ids.shape),
                              rewards=torch.zeros(len(ids)),
                              group_index=torch.zeros(len(ids), dtype=torch.long)), 2)
        gathers: list[float] = []

        def parts(new: Path) -> dict:
            step = int(new.name.removeprefix("step-"))
            model.save_pretrained(new / "model", safe_serialization=True,
                                  max_shard_size="1000GB")
            if tokenizer is not None:
                tokenizer.save_pretrained(new / "model")
            t0 = time.perf_counter()
            saved, rngs = leader.checkpoint_state()
            gathers.append(time.perf_counter() - t0)
            torch.save(saved, new / "trainer.pt")
            py, tensors = rng_state()
            add_rank_states(py, tensors, rngs)
            torch.save(tensors, new / "rng.pt")
            return {"step": step, "rng": py}

        def load(ckpt: Checkpoint) -> None:
            load_weights(model, ckpt)
            leader.load_checkpoint_state(load_tensors(ckpt.path / "trainer.pt"),
                                         rank_states(ckpt.state["rng"],
                                                     load_tensors(ckpt.path / "rng.pt")), 1)

        writes, reads, ckpt = timed_round_trips(run_dir, repeats, parts, load)
    finally:
        leader.close()
    params = sum(p.numel() for p in model.parameters())
    return {"model": f"{name}, {world} ranks", "params_M": round(params / 1e6, 2),
            "size_MiB": round(ckpt.size / 2**20, 1),
            "write_s_median": round(sorted(writes)[len(writes) // 2], 2),
            "gather_s_median": round(sorted(gathers)[len(gathers) // 2], 2),
            "read_s_median": round(sorted(reads)[len(reads) // 2], 2)}


def fingerprint_cost(name: str = SMOLLM2_NAME) -> dict[str, float | str] | None:
    """`model_fingerprint` (what a checkpoint records of model.path, read at each
    checkpointed run's start and each resume) of the fetched SmolLM2-135M, against SHA-256
    of its files whole; page cache hot (read once first). None when it is not fetched."""
    folder = models_dir() / name
    if not (folder / "config.json").is_file():
        return None
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    for p in files:  # hot, as in the other rows
        p.read_bytes()
    t0 = time.perf_counter()
    model_fingerprint(folder)
    sampled = time.perf_counter() - t0
    t0 = time.perf_counter()
    for p in files:
        hashlib.sha256(p.read_bytes()).hexdigest()
    return {"model": f"{name} (fetched) fingerprint", "MiB": round(sum(
        p.stat().st_size for p in files) / 2**20, 1), "fingerprint_s": round(sampled, 4),
        "sha256_whole_s": round(time.perf_counter() - t0, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None, help="folder to write in (default: temp)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--ranks", type=int, default=1,
                    help="N > 1: each model measured on N trainer ranks as well")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(dir=args.out) as tmp:
        root = Path(tmp)
        rows = []
        for name, make, folder in (("demo (configs/calculator.yaml)", demo_model, "demo"),
                                   ("random Llama, SmolLM2-135M shape",
                                    lambda _: llama_135m(), "llama")):
            rows.append(measure(name, *make(root / folder), root / folder, args.repeats))
            if args.ranks > 1:  # a fresh model: `measure` stepped the one before
                ranks = root / f"{folder}-ranks"
                rows.append(measure_ranks(name, *make(ranks), ranks, args.repeats,
                                          args.ranks))
        smollm2 = models_dir() / SMOLLM2_NAME
        if (smollm2 / "config.json").is_file():  # the real ~135M model, fetched
            rows.append(measure(f"{SMOLLM2_NAME} (fetched)", load_model(smollm2, torch.float32),
                                load_tokenizer(smollm2), root / "smollm2", args.repeats))
        else:
            print(f"{SMOLLM2_NAME} rows skipped: not fetched in {models_dir()} (tiller fetch "
                  f"{SMOLLM2_NAME}, or TILLER_MODELS_DIR)", file=sys.stderr)
    for row in [*rows, fingerprint_cost()]:
        if row is not None:
            print(json.dumps(row))


if __name__ == "__main__":
    main()
