"""Router test fixtures."""

from __future__ import annotations

import os
from collections.abc import Iterator
from types import SimpleNamespace

import pytest

from tests.router.agent_stack import agent_stack as _agent_stack
from tests.router.front_stack import RouterProc, SplitStack, tiny_stack


@pytest.fixture(scope="package")
def agent_stack(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: str
                ) -> Iterator[RouterProc]:
    """The SmolLM2 stack the tools/structured-output, Messages API and openai client
    tests share
    (KVSERVE_TEST_AGENT_URL=http://host:port points them at a running router instead)."""
    url = os.environ.get("KVSERVE_TEST_AGENT_URL")
    if url:
        yield SimpleNamespace(http=url)  # type: ignore[misc]
        return
    with _agent_stack(tmp_path_factory.mktemp("agent")) as router:
        yield router


@pytest.fixture(scope="package")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SplitStack]:
    """The tiny-dense stack test_front.py and test_front_input.py share (the same
    configuration; a start costs ~10 s of CPU on a 2-core box). Both only add
    requests with prompts of their own, and what they count is a delta or a
    never (no 500, nothing left in flight), so neither sees the other's."""
    with tiny_stack(tmp_path_factory.mktemp("tiny")) as stack:
        yield stack
