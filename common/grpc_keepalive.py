"""One keepalive policy for every gRPC channel and server of a deployment.

Clients ping an idle connection every ``KEEPALIVE_TIME_MS`` to find a dead
peer fast (the router must stop waiting on a killed instance). A gRPC server
counts a ping that arrives sooner than its minimum interval after the
previous one, with nothing sent between, as a strike, and after two strikes
answers GOAWAY "too_many_pings", which fails every call on that connection.
gRPC's default minimum is five minutes, so a decode stream that waited more
than half a minute for its first token (a queue under overload) collected
the router's pings as strikes and the router lost every stream to that
instance at once ("failed mid-stream: UNAVAILABLE: Too many pings", eight
answers cut at once on the cc50 replay). Servers accept pings at half the
clients' period.
"""

from __future__ import annotations

KEEPALIVE_TIME_MS = 10_000
KEEPALIVE_TIMEOUT_MS = 5_000
MIN_RECV_PING_INTERVAL_MS = KEEPALIVE_TIME_MS // 2

Options = list[tuple[str, int]]


def client_keepalive() -> Options:
    return [("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
            ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS)]


def server_keepalive() -> Options:
    """What a server sends (the same pings) and what it tolerates from clients."""
    return [("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
            ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
            ("grpc.http2.max_pings_without_data", 0),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.min_ping_interval_without_data_ms", MIN_RECV_PING_INTERVAL_MS)]
