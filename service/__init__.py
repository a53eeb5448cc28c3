"""The layer both engine services (prefill_svc, decode_svc) stand on: their
shared config pieces, engine thread, warehouse link and restore, block writer,
KV hand-off buffer, request checks, errors-to-status mapping, metrics and
hosting (health, registry, reflection)."""
