"""``rediss://`` works: the block index over TLS to a real Redis.

The bundled redis-server is built without TLS, so the test puts a real TLS
terminator (Python's ssl, certificate from the session CA) in front of the real
embedded Redis, as stunnel or a cloud Redis endpoint would; the client side is
the production code path (``BlockIndex`` from a ``rediss://`` URL that carries
the password and the CA).
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import threading
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from common.config import TrafficClasses
from kvstore.index import BlockIndex, IndexRecord
from kvstore.redis_server import EmbeddedRedis, free_port


@contextlib.contextmanager
def tls_terminator(cert_dir: Path, backend: tuple[str, int]) -> Iterator[int]:
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(cert_dir / "tls.crt", cert_dir / "tls.key")
    port = free_port()
    loop = asyncio.new_event_loop()
    started = threading.Event()

    async def pipe(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, OSError):
            while data := await r.read(65536):
                w.write(data)
                await w.drain()
        w.close()

    async def handle(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        br, bw = await asyncio.open_connection(*backend)
        await asyncio.gather(pipe(r, bw), pipe(br, w))

    async def main() -> None:
        server = await asyncio.start_server(handle, "127.0.0.1", port, ssl=ctx)
        started.set()
        async with server:
            await server.serve_forever()

    def run() -> None:
        # Cancelling the server is how it stops: not an error of the thread.
        with contextlib.suppress(asyncio.CancelledError):
            loop.run_until_complete(main())

    def cancel_all() -> None:        # on the loop's own thread: all_tasks is not thread-safe
        for task in asyncio.all_tasks(loop):
            task.cancel()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    started.wait(10)
    try:
        yield port
    finally:
        loop.call_soon_threadsafe(cancel_all)
        thread.join(5)


def test_block_index_over_rediss(tls_dir: str) -> None:
    with EmbeddedRedis() as redis, \
            tls_terminator(Path(tls_dir) / "kvstore", (redis.host, redis.port)) as port:
        auth = urlsplit(redis.url_for("kvstore")).netloc.rsplit("@", 1)[0]
        url = (f"rediss://{auth}@127.0.0.1:{port}/0"
               f"?ssl_ca_certs={Path(tls_dir) / 'ca' / 'ca.crt'}")
        keys = [bytes([i]) * 16 for i in range(1, 5)]

        async def body() -> None:
            async with BlockIndex(url, node="tls", classes=TrafficClasses(),
                                  publish_events=False) as ix:
                await ix.add([IndexRecord(k, 10, "chat", tenant="acme") for k in keys], tier="G3")
                assert (await ix.match_chain(keys, tenant="acme")).matched == 4
            # Without the CA the server's certificate is not trusted: no connection.
            untrusted = BlockIndex(url.split("?")[0], node="tls", classes=TrafficClasses())
            with pytest.raises(Exception, match=r"(?i)certificate|ssl"):
                await untrusted.start()
            await untrusted.close()

        asyncio.run(asyncio.wait_for(body(), 30))
