"""The engine: what samples tokens and takes weights. The `Engine` protocol (`api`), its
backends (`embedded`: continuous batching in-process; `http`: servers speaking SGLang's
`/generate`, behind a router), the KV prefix cache and the sampler they use, the weight updates
an engine applies (`updates`, `delta`), the trainer's side of a weight sync (`weight_sync`) and
`factory.make_engine`, which builds the backend the config names. See docs/engine.md."""
