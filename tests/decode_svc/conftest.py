"""The shared service stack (tests/decode_svc/stack.py)."""

from tests.decode_svc.stack import stack  # noqa: F401 - a fixture
