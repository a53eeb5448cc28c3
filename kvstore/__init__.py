"""The tiered KV-cache warehouse (DESIGN §2-5)."""
