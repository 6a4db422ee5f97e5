"""worker: the engine (scheduler, KV cache, runner, model) and its daemon."""
