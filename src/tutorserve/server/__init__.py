"""The OpenAI-compatible HTTP API (FastAPI): request validation, streaming, metrics, and the
tutor's routes; it only translates between HTTP and the engine's and the tutor's fronts."""
