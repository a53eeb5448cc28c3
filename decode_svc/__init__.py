"""decode_svc."""
