"""Router test fixtures."""

from __future__ import annotations

import os
from collections.abc import Iterator
from types import SimpleNamespace

import pytest

from tests.router.agent_stack import agent_stack as _agent_stack
from tests.router.front_stack import RouterProc


@pytest.fixture(scope="package")
def agent_stack(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: str
                ) -> Iterator[RouterProc]:
    """The SmolLM2 stack the tools/structured-output and Messages API tests share
    (KVSERVE_TEST_AGENT_URL=http://host:port points them at a running router instead)."""
    url = os.environ.get("KVSERVE_TEST_AGENT_URL")
    if url:
        yield SimpleNamespace(http=url)  # type: ignore[misc]
        return
    with _agent_stack(tmp_path_factory.mktemp("agent")) as router:
        yield router
