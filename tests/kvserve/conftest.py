"""The package's one ``kvserve up`` stack (tests/kvserve/up_stack.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.kvserve.up_stack import UpStack


@pytest.fixture(scope="package")
def up_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[UpStack]:
    stack = UpStack(tmp_path_factory.mktemp("up"))
    try:
        yield stack
    finally:
        stack.close()
