"""kvserve: disaggregated LLM serving with a tiered KV-cache warehouse."""

__version__ = "0.1.0"
