"""router.body_decode: every way a body can be bad comes back as one BodyProblem
(never an exception), with exact kinds, codes and params; valid bodies decode
to the same value json.loads gives."""

from __future__ import annotations

import gzip
import json
import zlib

import pytest

from router.body_decode import DecodeLimits, decode_body

L = DecodeLimits()
SMALL = DecodeLimits(max_bytes=1024, max_depth=4, max_values=10, max_int_digits=5)


@pytest.mark.parametrize(("raw", "enc", "limits", "kind", "code", "param"), [
    (b"[" * 5000 + b"]" * 5000, (), L, "invalid", "too_deep", "body"),
    (b"[[[[[1]]]]]", (), SMALL, "invalid", "too_deep", "body"),
    (b"[1,2,3,4,5,6,7,8,9,10,11]", (), SMALL, "invalid", "too_many_values", "body"),
    (b"[" + b"[]," * 300_000 + b"[]]", (), L, "invalid", "too_many_values", "body"),
    (b"[" + b'"",' * 300_000 + b'""]', (), L, "invalid", "too_many_values", "body"),
    (b"123456", (), SMALL, "invalid", "number_out_of_range", "body"),
    (b"-" + b"9" * 4301, (), L, "invalid", "number_out_of_range", "body"),
    (b'{"t": 1e400}', (), L, "invalid", "number_out_of_range", "body"),
    (b'{"t": -1E+999}', (), L, "invalid", "number_out_of_range", "body"),
    (b'{"t": NaN}', (), L, "invalid", "invalid_json", "body"),
    (b'{"t": Infinity}', (), L, "invalid", "invalid_json", "body"),
    (b'{"m": [{"c": "\\ud800"}]}', (), L, "invalid", "invalid_string", "m[0].c"),
    (b'{"\\udc00": 1}', (), L, "invalid", "invalid_string", "body"),
    (b"\xef\xbb\xbf{}", (), L, "invalid", "invalid_encoding", "body"),
    (b'{"a": "\xff"}', (), L, "invalid", "invalid_encoding", "body"),
    (b" \n\t", (), L, "invalid", "empty_body", "body"),
    (b'{"a": 1', (), L, "invalid", "invalid_json", "body"),
    (b"{}", ("gzip",), L, "invalid", "invalid_encoding", "body"),
    # mtime=0: the bytes are the test's id, which every pytest-xdist worker must collect alike
    (gzip.compress(b"{}", mtime=0)[:-4], ("gzip",), L, "invalid", "invalid_encoding", "body"),
    (gzip.compress(b"{}", mtime=0) + b"!", ("gzip",), L, "invalid", "invalid_encoding", "body"),
    (gzip.compress(b" " * 2000, mtime=0), ("gzip",), SMALL, "too_large", "request_too_large",
     "body"),
    (zlib.compress(b" " * 2000), ("deflate",), SMALL, "too_large", "request_too_large", "body"),
    (b"not deflate", ("deflate",), L, "invalid", "invalid_encoding", "body"),
])
def test_bad_bodies_are_one_problem_each(raw: bytes, enc: tuple[str, ...],
                                         limits: DecodeLimits, kind: str, code: str,
                                         param: str) -> None:
    out = decode_body(raw, enc, limits)
    assert out.problem is not None, out
    assert (out.problem.kind, out.problem.code, out.problem.param) == (kind, code, param)
    assert out.problem.message


@pytest.mark.parametrize("value", [
    {"model": "m", "messages": [{"role": "user", "content": "é \u2028 \\\" [{,}]"}]},
    {"prompt": list(range(100_000)), "seed": 2**64 - 1, "t": -1.5e-300},
    {"a": "\"" * 1000, "k": {"x": [[], {}, None, True, False]}},
    [1, 2], "s", 0,
])
def test_valid_bodies_decode_like_json(value: object) -> None:
    raw = json.dumps(value, ensure_ascii=False).encode()
    for enc, data in (((), raw), (("gzip",), gzip.compress(raw)),
                      (("deflate",), zlib.compress(raw)),
                      (("deflate",), zlib.compress(raw)[2:-4]),         # raw deflate
                      (("gzip", "gzip"), gzip.compress(gzip.compress(raw)))):
        out = decode_body(data, enc, L)
        assert out.problem is None, (enc, out.problem)
        assert out.value == value


def test_limits_are_validated() -> None:
    with pytest.raises(ValueError, match="max_depth"):
        DecodeLimits(max_depth=0)
