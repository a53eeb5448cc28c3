"""Integrations of kvserve with other engines (vLLM). Never imported by the core packages."""

import common.grpc_fork  # noqa: F401  (before anything imports grpc)
