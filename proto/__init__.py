"""kvserve.v1 protocol: .proto sources and their generated stubs (see build.py)."""
