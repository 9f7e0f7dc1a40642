"""`tierserve bench`: the field's serving workloads, a streaming load generator for any
OpenAI-compatible server, the field's metrics, and side-by-side runs with a report and plots.

    workloads  seeded generators in token space: multiturn, shared-prefix, random, trace
    client     async streaming client: per-request send/chunk/first-token times, usage, cache hits
    metrics    TTFT, TPOT, ITL, E2E (mean, median, p90, p99), throughput, cache hit rates
    report     JSON per run, a markdown report, PNG plots
    compare    start `tierserve serve` under named configurations and run one workload on each

See docs/bench.md for the exact semantics.
"""
