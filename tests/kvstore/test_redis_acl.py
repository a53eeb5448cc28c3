"""Redis least privilege on a real server (the embedded redis-server, started as
``kvserve up`` starts it, and the embedded Redis Cluster): each role's ACL user
does its own work and nothing else (kvstore/redis_acl.py)."""

from __future__ import annotations

import asyncio
import stat
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis

from common.config import TrafficClasses
from kvserve.cli import main
from kvstore.events import STREAM, EventReader
from kvstore.index import BlockIndex, IndexRecord
from kvstore.redis_acl import FORBIDDEN, ROLES, RedisRole, RedisUsers, role_acl
from kvstore.redis_cluster import EmbeddedRedisCluster
from kvstore.redis_server import EmbeddedRedis, free_port, redis_server_binary
from kvstore.registry import InstanceInfo, InstanceRegistry

# What no role's user may run: administration, whole-keyspace operations, code.
ADMIN_CALLS: dict[str, Callable[[redis.Redis], object]] = {
    "CONFIG GET": lambda r: r.config_get("dir"),
    "CONFIG SET": lambda r: r.config_set("dir", "/tmp"),
    "FLUSHALL": lambda r: r.flushall(),
    "FLUSHDB": lambda r: r.flushdb(),
    "KEYS": lambda r: r.keys("*"),
    "DEBUG": lambda r: r.execute_command("DEBUG", "SLEEP", "0"),
    "MODULE": lambda r: r.execute_command("MODULE", "LIST"),
    "SAVE": lambda r: r.save(),
    "BGSAVE": lambda r: r.bgsave(),
    "SHUTDOWN": lambda r: r.execute_command("SHUTDOWN", "NOSAVE"),
    "ACL": lambda r: r.acl_list(),
    "ACL SETUSER": lambda r: r.acl_setuser("x", enabled=True, commands=["+@all"], keys=["*"]),
    "MONITOR": lambda r: r.execute_command("MONITOR"),
    "REPLICAOF": lambda r: r.execute_command("REPLICAOF", "127.0.0.1", "1"),
    "SCRIPT FLUSH": lambda r: r.script_flush(),
    "SORT BY": lambda r: r.sort("kvserve:instances:kvstore", by="B*"),
    "CLIENT KILL": lambda r: r.execute_command("CLIENT", "KILL", "TYPE", "normal"),
    "SWAPDB": lambda r: r.execute_command("SWAPDB", "0", "1"),
}


@pytest.fixture(scope="module")
def server() -> Iterator[EmbeddedRedis]:
    with EmbeddedRedis() as s:
        yield s


@pytest.fixture()
def users(server: EmbeddedRedis) -> Iterator[EmbeddedRedis]:
    admin = redis.Redis.from_url(server.url)
    admin.flushall()
    admin.close()
    yield server


def client(server: EmbeddedRedis, role: str) -> redis.Redis:
    return redis.Redis.from_url(server.url_for(role), socket_timeout=5)


def refused(call: Callable[[], object]) -> bool:
    """True when Redis refuses the call (no permission, or the command is disabled)."""
    try:
        call()
    except redis.exceptions.NoPermissionError:
        return True
    except redis.ResponseError as exc:
        return "unknown command" in str(exc) or "NOPERM" in str(exc) or "no permission" in str(
            exc)
    return False


@pytest.mark.parametrize("role", ROLES)
def test_no_role_may_administer_the_server(users: EmbeddedRedis, role: str) -> None:
    r = client(users, role)
    assert r.ping()
    allowed = [name for name, call in ADMIN_CALLS.items() if not refused(lambda c=call: c(r))]
    assert allowed == []
    r.close()
    assert redis.Redis.from_url(users.url).ping()          # the server is still up


def test_the_default_user_is_off_and_passwords_are_per_role(users: EmbeddedRedis) -> None:
    bare = redis.Redis(host=users.host, port=users.port, protocol=2)
    with pytest.raises(redis.AuthenticationError, match=r"(?i)noauth|authentication"):
        bare.get("kvserve:ids")
    assert users.users is not None
    pw = users.users.passwords
    with pytest.raises(redis.AuthenticationError):          # the old form: default user
        redis.Redis(host=users.host, port=users.port, password=pw["kvstore"]).ping()
    with pytest.raises(redis.AuthenticationError):          # another role's password
        redis.Redis(host=users.host, port=users.port, username="kvstore",
                    password=pw["router"]).ping()
    assert len(set(pw.values())) == len(pw)


@pytest.mark.parametrize("role", [r for r in ROLES if r not in ("kvstore", "operator")])
def test_only_the_kvstore_touches_the_block_index(users: EmbeddedRedis, role: str) -> None:
    admin = redis.Redis.from_url(users.url)
    admin.set(b"B" + bytes(16), b"x" * 16)
    admin.hset("kvserve:ids", "tenant:n:acme", 1)
    r = client(users, role)
    for call in (lambda: r.get(b"B" + bytes(16)), lambda: r.set(b"B" + bytes(16), b"forged"),
                 lambda: r.delete(b"B" + bytes(16)), lambda: r.hset("kvserve:ids", "t", 9),
                 lambda: r.hgetall("kvserve:ids"), lambda: r.set("kvserve:index:epoch", "1"),
                 lambda: r.delete("kvserve:index:epoch"), lambda: r.sadd("kvserve:g2:n", "k"),
                 lambda: r.scan(0)):
        assert refused(call)
    # Nor through a script: Lua runs with the caller's permissions.
    assert refused(lambda: r.eval("return redis.call('SET', ARGV[1], 'forged')", 0,
                                  b"B" + bytes(16)))
    assert admin.get(b"B" + bytes(16)) == b"x" * 16
    r.close()
    admin.close()


@pytest.mark.parametrize("role", ["kvstore", "prefill", "decode", "router"])
def test_a_role_writes_only_its_own_registry_entries(users: EmbeddedRedis, role: str) -> None:
    other = "kvstore" if role != "kvstore" else "prefill"
    admin = redis.Redis.from_url(users.url)
    admin.hset(f"kvserve:inst:{other}:{other}-0", mapping={"role": other, "address": "a:1"})
    r = client(users, role)
    assert r.hset(f"kvserve:inst:{role}:{role}-9", "role", role) == 1
    if role != "router":        # Redis 6.2 has no read-only key patterns (redis_acl doc)
        assert refused(lambda: r.hset(f"kvserve:inst:{other}:{other}-0", "address", "evil:1"))
        assert refused(lambda: r.delete(f"kvserve:inst:{other}:{other}-0"))
        assert refused(lambda: r.srem(f"kvserve:instances:{other}", f"{other}-0"))
        assert admin.hget(f"kvserve:inst:{other}:{other}-0", "address") == b"a:1"
    assert refused(lambda: r.xadd(STREAM, {"kind": "stored", "keys": b""})) == (
        role not in ("kvstore",))
    r.close()
    admin.close()


def test_each_role_does_its_own_work(users: EmbeddedRedis) -> None:
    """The index as the kvstore user, heartbeats as each engine role, the
    router's view (registry + events) as the router user."""
    keys = [bytes([i]) * 16 for i in range(1, 9)]

    async def body() -> None:
        async with BlockIndex(users.url_for("kvstore"), node="n1", classes=TrafficClasses(),
                              instance="kvstore-n1") as ix:
            assert await ix.add([IndexRecord(k, 10, "chat", tenant="acme") for k in keys],
                                tier="G2") == 8
            assert (await ix.match_chain(keys, tenant="acme")).matched == 8
            assert await ix.remove(keys[4:], tier="G2") == 4
            assert await ix.delete(keys[:2]) == 2
            await ix.mark_epoch()
            assert await ix.epoch_present()
            assert await ix.reconcile_g2() == 2
        for role in ("kvstore", "prefill", "decode", "router"):
            async with InstanceRegistry(users.url_for(role), ttl_s=5) as reg:
                info = InstanceInfo(f"{role}-0", role, "127.0.0.1:1", node="n1")
                await reg.register(info)
                assert await reg.heartbeat(info.instance_id)
        async with InstanceRegistry(users.url_for("router")) as view:
            assert {i.role for i in await view.list_instances()} == {
                "kvstore", "prefill", "decode", "router"}
        reader = await EventReader(users.url_for("router"), start_id="0").pin()
        kinds = [e.kind for e in await reader.read(block_ms=100)]
        assert kinds[:3] == ["stored", "evicted", "deleted"]
        await reader.close()
        # An outside engine (vLLM) registers as prefill/decode and counts and announces.
        engine = redis.asyncio.Redis.from_url(users.url_for("engine"))
        await engine.hincrby("kvserve:vllm:stats:vllm-0", "saved_blocks", 3)
        await engine.xadd(STREAM, {"kind": "stored", "node": "n1", "tier": "G1",
                                   "instance": "vllm-0", "keys": keys[0]})
        async with InstanceRegistry(users.url_for("engine")) as reg:
            await reg.register(InstanceInfo("vllm-0", "prefill", "127.0.0.1:2"))
        await engine.aclose()
        assert refused(lambda: client(users, "engine").get(b"B" + keys[0]))

    asyncio.run(body())


def test_readers_accept_an_entry_only_under_its_own_roles_keys(users: EmbeddedRedis) -> None:
    """A prefill user cannot write a kvstore entry; one that names role kvstore
    under its own keys is not listed as a kvstore (nor at all)."""
    r = client(users, "prefill")
    r.hset("kvserve:inst:prefill:fake", mapping={"instance_id": "fake", "role": "kvstore",
                                                 "address": "evil:1"})
    r.sadd("kvserve:instances:prefill", "fake")
    r.close()

    async def body() -> list[InstanceInfo]:
        async with InstanceRegistry(users.url_for("operator")) as reg:
            return await reg.list_instances()

    assert asyncio.run(body()) == []


def test_operator_audits_but_cannot_administer(users: EmbeddedRedis) -> None:
    admin = redis.Redis.from_url(users.url)
    admin.set(b"B" + bytes(16), b"x" * 16)
    op = client(users, "operator")
    assert b"B" + bytes(16) in list(op.scan_iter(count=100))
    assert op.get(b"B" + bytes(16)) == b"x" * 16
    assert refused(lambda: op.flushall()) and refused(lambda: op.keys("*"))
    op.close()
    admin.close()


def test_no_role_is_granted_a_forbidden_command() -> None:
    for role in ROLES:
        rules = role_acl(role).rules(read_only_patterns=True)
        granted = {r[1:] for r in rules if r.startswith("+")}
        assert not granted & FORBIDDEN, role
        assert not any(r.startswith("+@") for r in rules), role     # commands, never categories
        assert "allkeys" not in rules and "&*" not in rules
    with pytest.raises(ValueError, match="forbidden"):
        RedisRole(commands=("get", "flushall"))
    # Redis 7 read-only patterns: the router may read others' entries, write only its own.
    router = role_acl("router").rules(read_only_patterns=True)
    assert "%R~kvserve:inst:*" in router and "~kvserve:inst:router:*" in router
    lines = RedisUsers.generate(admin=False).acl_lines()
    assert lines[0].startswith("user default off")
    assert all(">" not in line for line in lines)            # hashed passwords only


def test_the_acl_file_an_operator_generates_works_on_a_real_server(tmp_path: Path) -> None:
    """``kvserve certs redis-users`` (docs/security.md): its users.acl loads into a
    real redis-server (6.2 here, --redis6) and each role's URL file connects as
    that role; the placeholder ACL the base manifests ship makes Redis refuse."""
    port = free_port()
    assert main(["certs", "redis-users", str(tmp_path), "--address", f"127.0.0.1:{port}",
                 "--redis6"]) == 0
    acl = tmp_path / "redis" / "users.acl"
    assert stat.S_IMODE(acl.stat().st_mode) == 0o600 and ">" not in acl.read_text()
    with subprocess.Popen([redis_server_binary(), "--port", str(port), "--bind", "127.0.0.1",
                           "--save", "", "--aclfile", str(acl)],
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) as proc:
        try:
            urls = {r: (tmp_path / "redis" / f"{r}.url").read_text().strip() for r in ROLES}
            deadline = time.monotonic() + 10
            while True:
                try:
                    redis.Redis.from_url(urls["operator"]).ping()
                    break
                except redis.ConnectionError:
                    assert time.monotonic() < deadline
                    time.sleep(0.05)
            for url in urls.values():
                r = redis.Redis.from_url(url)
                assert r.ping()
                assert refused(r.flushall)
                r.close()
            kv = redis.Redis.from_url(urls["kvstore"])
            assert kv.set(b"B" + bytes(16), b"x" * 16)
            kv.close()
        finally:
            proc.terminate()
    shipped = Path(__file__).resolve().parents[2] / "k8s" / "base" / "redis-users.acl"
    refused_start = subprocess.run([redis_server_binary(), "--port", str(free_port()),
                                    "--save", "", "--aclfile", str(shipped)],
                                   capture_output=True, text=True, timeout=30)
    assert "ACL errors" in refused_start.stdout + refused_start.stderr


def test_a_cluster_node_is_locked_down_too(redis_cluster: EmbeddedRedisCluster,
                                          cluster_url: str) -> None:
    keys = [bytes([i]) * 16 for i in range(1, 65)]

    async def body() -> None:
        async with BlockIndex(redis_cluster.url_for("kvstore"), node="c1",
                              classes=TrafficClasses()) as ix:
            await ix.add([IndexRecord(k, 10, "chat") for k in keys], tier="G3")
            assert (await ix.match_chain(keys)).matched == 64

    asyncio.run(body())
    port = redis_cluster.master_ports()[0]
    assert redis_cluster.users is not None
    for role in ("kvstore", "router"):
        node = redis.Redis(host=redis_cluster.host, port=port, username=role,
                           password=redis_cluster.users.passwords[role])
        for name in ("CONFIG GET", "FLUSHALL", "KEYS", "DEBUG", "SHUTDOWN", "ACL"):
            assert refused(lambda c=ADMIN_CALLS[name], n=node: c(n)), (role, name)
        assert refused(lambda n=node: n.execute_command("CLUSTER", "RESET"))
        node.close()
    bare = redis.Redis(host=redis_cluster.host, port=port, protocol=2)
    with pytest.raises(redis.AuthenticationError):
        bare.get("x")
