"""Thin Prefect wrappers, one module per stage: call the logic packages, publish artifacts, return small
manifests (never tensors). Caching is off on purpose: each stage checks its own durable record (prepared
manifest, store commit records), which survives new flow runs where Prefect's run-scoped cache does not."""
