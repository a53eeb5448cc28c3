"""The tiered KV-cache warehouse (docs/architecture.md#block-identity)."""
