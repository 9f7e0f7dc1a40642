"""`tierserve batch`: OpenAI Batch files and `--regenerate` datasets run as client-side jobs
against a server (or one started in this process), resumable from their output files
(docs/server.md). A layer above the server, which knows nothing of them."""
