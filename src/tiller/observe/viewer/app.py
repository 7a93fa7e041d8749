"""The `tiller view` app: `create_app(run_dir)` serves a run's traces.sqlite and metrics.jsonl
to the pages in `static/` (plain HTML, JS and CSS shipped in the package: no CDN, nothing
fetched from outside).

The database is opened read-only (`mode=ro`), one connection per request, so a training that
is still running keeps writing it; the pages ask for one page of episodes at a time. It serves
127.0.0.1 only, behind tiller's HTTP guard (`tiller.serve.guard.Guard`: a Host other than a
loopback name is 421, so a DNS-rebinding page cannot read the traces; any request but GET and
HEAD needs a JSON Content-Type, 415) and connection limits (`tiller.serve.listen`).

    GET /                          the single-page viewer (static/index.html)
    GET /api/run                   counts by phase and status, RL step range, run facts
    GET /api/episodes?...          one page of episode summaries under the filters
    GET /api/episodes/{id}         one episode: messages, tool calls, per-token arrays + text
    GET /api/episodes/{id}/group   the episodes of its group (sampled together; eval: its task)
    GET /api/curves                the RL steps' metrics and the held-out evaluations
"""

from __future__ import annotations

import math
import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any, Literal

from fastapi import FastAPI, HTTPException, Query
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

from tiller.errors import RunFolderError
from tiller.observe.report import load_run
from tiller.observe.traces import connect
from tiller.observe.viewer import queries
from tiller.serve import listen
from tiller.serve.guard import Guard, Hosts

STATIC = Path(__file__).parent / "static"
# the metrics the curves page draws (those the run logged)
CURVES = ("reward_mean", "success_rate", "zero_variance_group_frac", "tool_calls_per_episode",
          "tool_errors_per_episode", "env_error_rate", "truncated_rate", "response_tokens_mean",
          "turns_mean", "entropy", "kl", "clip_frac", "grad_norm", "logp_mismatch_mean",
          "logp_mismatch_max", "staleness_mean", "step_s")
# where a run folder keeps a tokenizer, most recent first
TOKENIZER_DIRS = ("checkpoints/final", "checkpoints/sft", "base_model")
Status = Literal["completed", "truncated", "aborted", "env_error"]
HOST = "127.0.0.1"  # the traces hold every prompt and answer of the run: loopback only
MAX_BODY_BYTES = 1 << 16  # no route takes a body
# a browser opens a few connections per page; idle ones are dropped after uvicorn's 5 s
LIMITS = listen.ConnectionLimits(read_timeout_s=10.0, keep_alive_s=5, max_connections=128)


def find_tokenizer(run_dir: Path) -> Any | None:
    """The run's tokenizer (a `tokenizers.Tokenizer` from its tokenizer.json), to show each
    token's text; None when the run folder has none yet (tokens then show as ids)."""
    from tokenizers import Tokenizer

    for sub in TOKENIZER_DIRS:
        path = run_dir / sub / "tokenizer.json"
        if path.is_file():
            return Tokenizer.from_file(str(path))
    return None


class TokenTexts:
    """Each token id's text, decoded alone (a byte-level token that is part of a multi-byte
    character shows as U+FFFD), cached per id."""

    def __init__(self, tokenizer: Any | None):
        self.tokenizer, self._cache = tokenizer, {}

    def __call__(self, ids: list[int]) -> list[str]:
        if self.tokenizer is None:
            return [f"<{i}>" for i in ids]
        for i in set(ids) - self._cache.keys():
            self._cache[i] = self.tokenizer.decode([i], skip_special_tokens=False)
        return [self._cache[i] for i in ids]


def _finite(row: dict[str, Any]) -> dict[str, Any]:
    # JSON has no NaN: a metric that was NaN (an empty eval's success) is sent as null
    return {k: None if isinstance(v, float) and not math.isfinite(v) else v
            for k, v in row.items()}


@contextmanager
def _reading(db: Path) -> Iterator[sqlite3.Connection]:
    """A read-only connection for one request, opened and closed in the thread that runs the
    route (an sqlite3 connection may not change threads; a dependency may run in another)."""
    con = connect(db)
    try:
        yield con
    finally:
        con.close()


def create_app(run_dir: str | Path) -> FastAPI:
    """The viewer over `run_dir`; a folder without traces.sqlite is one RunFolderError."""
    run_dir = Path(run_dir)
    db = run_dir / "traces.sqlite"
    if not db.is_file():
        raise RunFolderError(f"{run_dir} has no traces.sqlite (is it a run folder? traces are "
                             f"written when observe.traces.enabled=true)")
    connect(db).close()  # another schema version is one line at start-up, not a 500 a page
    texts = TokenTexts(find_tokenizer(run_dir))
    app = FastAPI(title="tiller view", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(Guard, max_body_bytes=MAX_BODY_BYTES, hosts=Hosts(HOST))
    app.mount("/static", StaticFiles(directory=STATIC), name="static")

    @app.get("/")
    def index() -> FileResponse:
        return FileResponse(STATIC / "index.html")

    @app.get("/api/run")
    def run_facts() -> dict[str, Any]:
        with _reading(db) as con:
            return {"run_dir": str(run_dir.resolve()), "name": run_dir.name,
                    "tokens_as_text": texts.tokenizer is not None, **queries.overview(con)}

    @app.get("/api/episodes")
    def episodes(
        phase: str | None = None, status: Status | None = None,
        step_min: int | None = None, step_max: int | None = None,
        reward_min: float | None = None, reward_max: float | None = None,
        env_error: bool | None = None, tool_errors_min: Annotated[int | None, Query(ge=0)] = None,
        tokens_min: Annotated[int | None, Query(ge=0)] = None,
        tokens_max: Annotated[int | None, Query(ge=0)] = None,
        trained: bool | None = None, q: Annotated[str | None, Query(max_length=200)] = None,
        order: queries.Order = "id", desc: bool = False,
        limit: Annotated[int, Query(ge=1, le=500)] = 50,
        offset: Annotated[int, Query(ge=0)] = 0,
    ) -> dict[str, Any]:
        flt = queries.EpisodeFilter(phase, status, step_min, step_max, reward_min, reward_max,
                                    env_error, tool_errors_min, tokens_min, tokens_max,
                                    trained, q or None)
        with _reading(db) as con:
            return queries.page(con, flt, order, desc, limit, offset)

    @app.get("/api/episodes/{episode_id}")
    def one_episode(episode_id: int) -> dict[str, Any]:
        with _reading(db) as con:
            ep = queries.episode(con, episode_id)
        if ep is None:
            raise HTTPException(404, f"no episode {episode_id} in {db}")
        ep["arrays"]["text"] = texts(ep["arrays"]["token_ids"])
        return ep

    @app.get("/api/episodes/{episode_id}/group")
    def episode_group(episode_id: int) -> dict[str, Any]:
        with _reading(db) as con:
            members = queries.group(con, episode_id)
        if members is None:
            raise HTTPException(404, f"no episode {episode_id} in {db}")
        return {"episode_id": episode_id, "members": members}

    @app.get("/api/curves")
    def curves() -> dict[str, Any]:
        try:
            run = load_run(run_dir)
        except RunFolderError as e:
            raise HTTPException(500, str(e)) from e
        keys = [k for k in CURVES if any(k in r for r in run.rl)]
        return {"steps": [r.get("phase_step") for r in run.rl],
                "series": {k: [_finite(r).get(k) for r in run.rl] for k in keys},
                "evals": [{"label": label, **_finite(r)} for label, r in run.evals()]}

    return app


def viewer_server(app: FastAPI, port: int) -> tuple[Any, listen.ConnectionGuard]:
    """The uvicorn server of `tiller view` on 127.0.0.1:`port`, with the viewer's limits (and
    the guard counting its refusals)."""
    return listen.server(app, LIMITS, name="tiller view", host=HOST, port=port,
                         timeout_graceful_shutdown=2)
