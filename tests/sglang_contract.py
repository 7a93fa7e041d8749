"""Run inside the SGLang side environment (.venv-sglang, scripts/setup.sh --sglang) by
tests/test_sglang_contract.py: SGLang 0.5.23's own request classes and validation judge the
request bodies tiller builds, and SGLang's own helpers build the answers tiller must read.

Reads one JSON object on stdin, writes one on stdout:
- "requests": [[route, body], ...] -> "verdicts": ["ok" or the error SGLang raises, ...]. A
  body goes through what SGLang's HTTP server does with it: the route must be one the server
  declares (http_server.py's decorators); FastAPI's pydantic parse into the route's class;
  for /generate, the schema gate `generate_contract_error`, `normalize_batch_and_arguments`,
  and `SamplingParams(**sampling_params)`, `.normalize(None)`, `.verify(vocab_size)` as the
  tokenizer manager's `_create_tokenized_object` does.
- always -> "model_info_keys": the keys of the JSON object SGLang's `GET /model_info` route
  answers with (the dict literal its handler in http_server.py builds), where tiller reads
  the weight version back after a push.
- "answers": [spec, ...] -> "built": [answer, ...]: a non-streamed /generate answer assembled
  as `TokenizerManager._handle_batch_output` does (finish reason `to_json`, logprob tuples as
  `detokenize_logprob_tokens` makes them, `add_weight_versions_to_meta_info`), passed through
  orjson and the schema decoder `GenerateResponse.from_json_value`.

torchvision's PyPI wheel is a CUDA build that cannot load its ops next to torch+cpu, and its
import registers fakes for two ops it then finds undefined; only their schemas are declared
here, before SGLang imports torchvision (no SGLang code is replaced).
"""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path

import torch

_TV = torch.library.Library("torchvision", "DEF")
for _op in ("nms", "qnms"):
    _TV.define(f"{_op}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")

import orjson  # noqa: E402
import pydantic  # noqa: E402
import sglang.srt.entrypoints.api_contract as api_contract  # noqa: E402
from sglang.api.v1.api_types import GenerateResponse  # noqa: E402
from sglang.srt.managers import io_struct  # noqa: E402
from sglang.srt.managers.schedule_batch import (  # noqa: E402
    FINISH_ABORT,
    FINISH_LENGTH,
    FINISH_MATCHED_TOKEN,
)
from sglang.srt.sampling.sampling_params import SamplingParams  # noqa: E402
from sglang.srt.utils.weight_versions import (  # noqa: E402
    WeightVersionEvent,
    add_weight_versions_to_meta_info,
    compute_weight_version_spans,
)

ROUTE_CLASSES = {
    "/generate": io_struct.GenerateReqInput,
    "/abort_request": io_struct.AbortReq,
    "/pause_generation": io_struct.PauseGenerationReqInput,
    "/continue_generation": io_struct.ContinueGenerationReqInput,
    "/update_weights_from_disk": io_struct.UpdateWeightFromDiskReqInput,
    "/flush_cache": None,  # no body: an optional ?timeout= query
}


def declared_routes() -> set[tuple[str, str]]:
    """(method, path) of every route SGLang's HTTP server declares."""
    tree = ast.parse((Path(api_contract.__file__).parent / "http_server.py").read_text())
    routes = set()
    for node in ast.walk(tree):
        for deco in getattr(node, "decorator_list", []):
            if not (isinstance(deco, ast.Call) and isinstance(deco.func, ast.Attribute)
                    and deco.args and isinstance(deco.args[0], ast.Constant)):
                continue
            kind, path = deco.func.attr, deco.args[0].value
            if kind in ("get", "post"):
                routes.add((kind.upper(), path))
            elif kind == "api_route":
                for kw in deco.keywords:
                    if kw.arg == "methods":
                        routes |= {(m.value, path) for m in kw.value.elts}
    return routes


def model_info_keys() -> list[str]:
    """The string keys of the dict literal(s) in the handler of SGLang's GET /model_info."""
    tree = ast.parse((Path(api_contract.__file__).parent / "http_server.py").read_text())
    for node in ast.walk(tree):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        routes = [d.args[0].value for d in node.decorator_list
                  if isinstance(d, ast.Call) and isinstance(d.func, ast.Attribute)
                  and d.func.attr == "get" and d.args and isinstance(d.args[0], ast.Constant)]
        if "/model_info" in routes:
            return [k.value for d in ast.walk(node) if isinstance(d, ast.Dict)
                    for k in d.keys if isinstance(k, ast.Constant)]
    return []


def judge(route: str, body: dict, vocab_size: int, routes: set) -> str:
    method = "GET" if body is None else "POST"
    if (method, route) not in routes:
        return f"no route {method} {route}"
    cls = ROUTE_CLASSES.get(route, "unknown")
    if cls == "unknown" or cls is None:
        return "ok"
    try:
        obj = pydantic.TypeAdapter(cls).validate_python(body)
        if route != "/generate":
            return "ok"
        error = api_contract.generate_contract_error(body)
        if error is not None:
            return f"400 {error}"
        obj.normalize_batch_and_arguments()
        params = SamplingParams(**obj.sampling_params)
        params.normalize(None)
        params.verify(vocab_size)
    except Exception as e:  # the verdict is the error text, judged by the test
        return f"{type(e).__name__}: {e}"
    return "ok"


def detok(logprobs: list, ids: list) -> list:
    """`TokenizerManager.detokenize_logprob_tokens` without text (return_text_in_logprobs
    false): (logprob, token_id, None) per token. Its module imports the whole server stack
    (fastapi, opentelemetry, ...), so its three lines are restated here; the schema decoder
    below checks the result as `LogprobEntry`s."""
    return [(logprob, token_id, None) for logprob, token_id in zip(logprobs, ids, strict=True)]


def build(spec: dict) -> dict:
    """A /generate answer from `spec`: output_ids, logprobs, finish ("stop", "length",
    "abort"), weight_version, version_events [[old_version, n_tokens], ...], prompt_tokens,
    cached_tokens; input ids and logprobs for a prefill-only probe (input_ids,
    input_logprobs, with None for the first token as SGLang's scheduler sends it)."""
    ids = spec["output_ids"]
    finish = {"stop": lambda: FINISH_MATCHED_TOKEN(ids[-1] if ids else 0),
              "length": lambda: FINISH_LENGTH(len(ids)),
              "abort": lambda: FINISH_ABORT()}[spec["finish"]]().to_json()
    meta = {"id": "r", "finish_reason": finish, "prompt_tokens": spec["prompt_tokens"],
            "weight_version": spec["weight_version"], "num_retractions": 0}
    meta["input_token_logprobs"] = detok(spec.get("input_logprobs", []),
                                         spec.get("input_ids", []))
    meta["output_token_logprobs"] = detok(spec["logprobs"], ids)
    meta["output_token_logprobs_length"] = len(ids)
    meta.update({"reasoning_tokens": 0, "completion_tokens": len(ids),
                 "cached_tokens": spec.get("cached_tokens", 0)})
    if spec.get("version_events"):
        events = [WeightVersionEvent(old_version=v, num_output_tokens=n)
                  for v, n in spec["version_events"]]
        spans = compute_weight_version_spans(events, spec["weight_version"], len(ids))
        add_weight_versions_to_meta_info(meta, spans, num_output_tokens=len(ids))
    answer = json.loads(orjson.dumps({"text": "", "output_ids": ids, "meta_info": meta}))
    GenerateResponse.from_json_value(answer)  # the schema's own check of the answer
    return answer


def main() -> None:
    job = json.load(sys.stdin)
    routes = declared_routes()
    out = {"verdicts": [judge(route, body, job.get("vocab_size", 1000), routes)
                        for route, body in job.get("requests", [])],
           "built": [build(spec) for spec in job.get("answers", [])],
           "model_info_keys": model_info_keys()}
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()
