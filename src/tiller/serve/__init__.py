"""`tiller serve`: an HTTP server over the embedded engine, with an SGLang-style /generate,
OpenAI-compatible completions and chat completions, and the control routes a trainer needs
(weight updates from disk, abort, pause/continue, cache flush). It needs the `serve` extra
(FastAPI and uvicorn); see docs/engine.md."""
