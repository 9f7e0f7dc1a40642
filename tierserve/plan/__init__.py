"""`tierserve plan`: size the KV cache before launch, for tierserve, SGLang and vLLM (the numbers,
their verdict, each engine's launch line and rules; docs/plan.md)."""
