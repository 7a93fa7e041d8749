"""The engine: what samples tokens and takes weights. The `Engine` protocol (`api`), its
backends (`embedded`: continuous batching in-process; `http`: `tiller serve` servers,
`sglang`: SGLang servers, behind one router with a wire dialect each), the KV prefix cache and
the sampler they use, the weight updates an engine applies (`updates`, `delta`), the trainer's
side of a weight sync (`weight_sync`) and `factory.make_engine`, which builds the backend the
config names. See docs/engine.md."""
