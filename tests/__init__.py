import common.grpc_fork  # noqa: F401  (before anything imports grpc)
