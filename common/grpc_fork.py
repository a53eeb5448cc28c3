"""Turns gRPC's fork handlers off (unless the operator set ``GRPC_ENABLE_FORK_SUPPORT``)
in every process that imports this before ``grpc``.

With them on, a process whose gRPC threads are busy forks a child (``subprocess`` with
``preexec_fn``, the multiprocessing resource tracker, vLLM's workers) and the child runs
gRPC's post-fork handler, which can abort it (``ev_epoll1_linux.cc: Check failed:
next_worker->state == KICKED``) before it ever execs: a store or engine that never starts.
kvserve never uses gRPC in a forked child without exec, which is all the handlers are for.
gRPC reads the variable once, when ``grpc`` is first imported, so the importers are the
packages at each process's entry: ``kvserve`` (every command), ``connectors`` (the vLLM
processes) and ``tests``.
"""

import os

os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "0")
