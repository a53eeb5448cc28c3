"""Integrations of kvserve with other engines (vLLM). Never imported by the core packages."""
