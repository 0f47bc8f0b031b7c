"""The serving engine: requests, the scheduler, the paged KV cache (block pool, prefix cache,
KV tiers), the model runner and sampling; `AsyncEngine` is its one front."""
