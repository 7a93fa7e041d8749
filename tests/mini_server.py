"""A minimal server of SGLang's /generate contract over a real EmbeddedEngine, for the HTTP
backend's tests until `tiller serve` lands: `/generate`, `/update_weights_from_disk`,
`/get_model_info` and `/health`, nothing else. Run as
`python tests/mini_server.py MODEL_DIR --port N [--version-offset K]`; a non-zero
`--version-offset` makes it echo a wrong weight version (a server that is not what it claims).
"""

from __future__ import annotations

import argparse
import asyncio

import torch
import uvicorn
from fastapi import FastAPI

from tiller.models import load_model, load_tokenizer
from tiller.rollout.engine import EmbeddedEngine, SamplingParams
from tiller.rollout.weight_sync import WeightUpdate


def make_app(model_dir: str, version_offset: int) -> FastAPI:
    torch.set_num_threads(1)
    tokenizer = load_tokenizer(model_dir)
    engine = EmbeddedEngine(load_model(model_dir), tokenizer.pad_token_id)
    app = FastAPI()

    @app.get("/health")
    async def health() -> dict:
        return {}

    @app.get("/get_model_info")
    async def model_info() -> dict:
        return {"model_path": model_dir, "vocab_size": engine.model.config.vocab_size,
                "max_context": engine.max_context, "weight_version": engine.version}

    @app.post("/generate")
    async def generate(body: dict) -> dict:
        sp = body["sampling_params"]
        params = SamplingParams(temperature=sp["temperature"], top_p=sp["top_p"],
                                top_k=sp["top_k"], max_new_tokens=sp["max_new_tokens"],
                                stop_token_ids=tuple(sp["stop_token_ids"]))
        gen = await engine.generate(body["input_ids"], params, sp["seed"])
        return {"output_ids": gen.token_ids, "meta_info": {
            "finish_reason": {"type": gen.finish_reason},
            "output_token_logprobs": [[lp, t, None]
                                      for lp, t in zip(gen.logprobs, gen.token_ids, strict=True)],
            "weight_version": gen.version, "prompt_tokens": len(body["input_ids"]),
            "cached_tokens": 0, "id": body["rid"]}}

    @app.post("/update_weights_from_disk")
    async def update_weights(body: dict) -> dict:
        update = WeightUpdate.load(body["model_path"], body["weight_version"], engine.model)
        await asyncio.to_thread(engine.update_weights, update)
        return {"success": True, "weight_version": engine.version + version_offset}

    return app


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("model_dir")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--version-offset", type=int, default=0)
    args = parser.parse_args()
    uvicorn.run(make_app(args.model_dir, args.version_offset), host="127.0.0.1", port=args.port,
                log_level="warning")
