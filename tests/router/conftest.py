"""Router test fixtures."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.router.agent_stack import agent_stack as _agent_stack
from tests.router.front_stack import RouterProc


@pytest.fixture(scope="session")
def agent_stack(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: str
                ) -> Iterator[RouterProc]:
    """The SmolLM2 stack the tools/structured-output and Messages API tests share."""
    with _agent_stack(tmp_path_factory.mktemp("agent")) as router:
        yield router
