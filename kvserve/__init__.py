"""kvserve: disaggregated LLM serving with a tiered KV-cache warehouse."""

import common.grpc_fork  # noqa: F401  (before anything imports grpc)

__version__ = "0.1.0"
