"""prefill_svc."""
