"""SGLang-style routes in tiller's dialect (`tiller.engine.wire.TillerDialect`: `seed`, integer
weight versions, deltas): /generate, /update_weights_from_disk and /abort_request, and tiller's
/score (the weight sync's parity check)."""

from __future__ import annotations

import asyncio
import logging
import secrets
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from fastapi import Request
from safetensors import SafetensorError

from tiller.engine.delta import DeltaUpdate
from tiller.engine.parts import PartsUpdate
from tiller.engine.updates import VersionFile, WeightsInconsistent, WeightSyncError, WeightUpdate
from tiller.serve.guard import opened_below, read_below, resolve_below
from tiller.serve.protocol import (
    AbortRequest,
    APIError,
    GenerateRequest,
    ScoreRequest,
    UpdateWeightsRequest,
    parse_body,
    read_body,
)
from tiller.serve.server import Server, client_of, draw_seed, finish_reason

logger = logging.getLogger(__name__)


async def generate(server: Server, request: Request) -> dict[str, Any]:
    """POST /generate, SGLang-style."""
    body, prompt = await asyncio.to_thread(_generate_inputs, server, await request.body())
    sp = body.sampling_params
    params = server.sampling(temperature=sp.temperature, top_p=sp.top_p, top_k=sp.top_k,
                             max_new_tokens=sp.max_new_tokens, stop_token_ids=sp.stop_token_ids)
    seed = draw_seed(sp.seed)
    rid = body.rid or secrets.token_hex(16)
    (g,) = await server.generate(prompt, params, [seed], rid=rid, session_id=body.session_id,
                                 client=client_of(request))
    meta: dict[str, Any] = {
        "id": rid, "finish_reason": finish_reason(g), "prompt_tokens": len(prompt),
        "completion_tokens": len(g.token_ids), "cached_tokens": g.cached_tokens,
        "weight_version": g.version, "output_token_weight_versions": list(g.versions),
        "seed": seed, "boot_id": server.boot_id,
        # tiller: which logprob output_token_logprobs holds under top-k / top-p (always the
        # distribution sampled from, renormalised over the kept set; docs/engine.md)
        "logprob_kind": params.logprobs,
    }
    if body.return_logprob:
        meta["output_token_logprobs"] = [
            [lp, t, None] for lp, t in zip(g.logprobs, g.token_ids, strict=True)]
    return {"text": server.completion_text(g.token_ids, params), "output_ids": g.token_ids,
            "meta_info": meta}


def _generate_inputs(server: Server, raw: bytes) -> tuple[GenerateRequest, list[int]]:
    """/generate's body and prompt ids, checked (run in a worker thread: parsing and
    tokenizing a large body takes a while)."""
    body: GenerateRequest = parse_body(raw, GenerateRequest)
    sp = body.sampling_params
    if (body.text is None) == (body.input_ids is None):
        raise APIError(400, "give exactly one of 'text' and 'input_ids'")
    if body.stream:
        raise APIError(400, "stream=true is not supported by /generate; use "
                            "/v1/completions with stream=true")
    if sp.stop:
        raise APIError(400, "stop strings are not supported; use sampling_params.stop_token_ids")
    if body.text is not None:
        server.check_text(len(body.text))
    prompt = body.input_ids if body.input_ids is not None else server.tokenizer.encode(body.text)
    server.check_prompt(prompt, sp.max_new_tokens)
    return body, prompt


def _read_update(root: Path, folder: Path, files: dict[str, Path], version: int, engine: Any
                 ) -> WeightUpdate | DeltaUpdate | PartsUpdate:
    """The update in `folder`: a delta when its tiller_version.json says so, per-rank parts
    (kind parts: every rank's part file must be there) or else a full checkpoint; a delta, or
    parts with a delta among them, is refused unless the engine holds its base version; with
    the sender's checksums when the json (or the parts) have them. The json is read under the
    rules of --weights-root (`read_below`) and validated (`VersionFile`: a malformed one is a
    WeightSyncError, so a 400); every tensor file is read from the descriptor of the checked
    file (`opened_below`), never looked up again by name. `engine.update_weights` checks the
    whole update before writing anything."""
    meta = VersionFile.parse(read_below(root, folder / "tiller_version.json"))
    update: DeltaUpdate | PartsUpdate
    with ExitStack() as opened:
        if meta.kind == "full":
            paths = [opened.enter_context(opened_below(root, f)) for f in files.values()]
            return WeightUpdate.load(folder, version, engine.model, files=paths,
                                     checksums=meta.checksums, partial=meta.partial)
        if meta.kind == "parts":  # every rank's part read now, from the checked files
            update = PartsUpdate.load(meta, {
                name: opened.enter_context(opened_below(root, f))
                for name, f in files.items() if name.startswith("part-")}, version)
        elif "delta.safetensors" not in files:
            raise WeightSyncError("tiller_version.json says kind 'delta' and there is no "
                                  "delta.safetensors beside it")
        else:
            update = DeltaUpdate.load(opened.enter_context(opened_below(
                root, files["delta.safetensors"])), meta, version)
    if update.base_version is not None and update.base_version != engine.version:
        raise WeightSyncError(f"delta update v{version} is against base version "
                              f"v{update.base_version}, but this server holds "
                              f"v{engine.version}: push a full update")
    return update


async def update_weights(server: Server, request: Request) -> dict[str, Any]:
    """POST /update_weights_from_disk: a checkpoint folder below --weights-root (or a delta
    written by tiller's weight sync). An update that does not fit the model or whose checksums
    do not match is a 400 and changes nothing; a 500 only when writing it went wrong (the
    weights are then neither version)."""
    body: UpdateWeightsRequest = await read_body(request, UpdateWeightsRequest)
    root = server.settings.weights_root
    if root is None:
        raise APIError(403, "weight updates from disk are off: start tiller serve with "
                            "--weights-root DIR and put checkpoints below DIR")
    engine = server.engine
    async with server.update_lock:  # checked here, so nothing changes between check and load
        folder, files = await asyncio.to_thread(resolve_below, root, body.model_path)
        version = engine.version + 1 if body.weight_version is None else body.weight_version
        policy = "abort" if body.abort_all_requests else "continue"
        try:
            update = await asyncio.to_thread(_read_update, root, folder, files, version,
                                             engine)
        except (WeightSyncError, SafetensorError, OSError, KeyError, ValueError) as e:
            raise APIError(400, f"cannot load {body.model_path!r}: {type(e).__name__}: {e}"
                           [:500]) from e  # nothing was applied
        try:
            applied = await asyncio.to_thread(engine.update_weights, update, in_flight=policy)
        except WeightsInconsistent as e:  # written, and not what was sent
            raise APIError(500, f"applying {body.model_path!r} failed: {e}"[:500]) from e
        except WeightSyncError as e:  # refused whole: the weights and version are unchanged
            raise APIError(400, f"refused {body.model_path!r}, nothing was applied: {e}"
                           [:500]) from e
    logger.info("weights updated from %s to version %d", folder, applied)
    return {"success": True, "message": f"loaded {body.model_path!r} as version {applied}",
            "weight_version": applied, "boot_id": server.boot_id}


async def score(server: Server, request: Request) -> dict[str, Any]:
    """POST /score {input_ids}: log p(token_i | tokens_<i) at temperature 1 for i >= 1 under the
    current weights, and their version (read under the update lock, so they match)."""
    body: ScoreRequest = await read_body(request, ScoreRequest)
    server.check_prompt(body.input_ids, 0)
    async with server.update_lock:
        logprobs = await asyncio.to_thread(server.engine.score, body.input_ids)
        return {"logprobs": logprobs, "weight_version": server.engine.version}


async def abort(server: Server, request: Request) -> dict[str, Any]:
    """POST /abort_request {rid} or {abort_all: true}: the aborted requests answer with their
    partial output and finish_reason abort."""
    body: AbortRequest = await read_body(request, AbortRequest)
    if body.abort_all == (body.rid is not None):
        raise APIError(400, "give either 'rid' or 'abort_all': true")
    if body.abort_all:
        ids = [i for ids in server.inflight.values() for i in ids]
    elif body.rid in server.inflight:
        ids = server.inflight[body.rid]
    else:
        raise APIError(404, f"no request with rid {body.rid!r} is in flight")
    aborted = [await asyncio.to_thread(server.engine.abort, i) for i in ids]
    return {"success": True, "aborted": sum(aborted)}
