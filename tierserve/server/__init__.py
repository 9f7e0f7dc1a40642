"""The OpenAI-compatible HTTP server, its engine thread and grammar compile pool, and the batch
runner (docs/server.md)."""
