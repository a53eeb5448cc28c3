"""The ConfigMap's kvserve config is loaded by kvserve's own
loader and `kvserve config check`, and every kvserve container's args parse
as a real subcommand with real flags. Manifests and code cannot drift."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from common.config import KVServeConfig
from kvserve.cli import build_parser, main
from tests.k8s.manifests import (
    CONFIG_KEY,
    CONFIG_MAP,
    K8S,
    Container,
    Manifest,
    pod_labels,
    pod_spec,
    quantity,
    selector_matches,
)

VAR_REF = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")
# What the kubelet substitutes for $(VAR) at run time, in the shape the flag expects.
SAMPLE_ENV = {"POD_IP": "10.1.2.3", "NODE_NAME": "node-a"}
SERVE_COMMANDS = {"kvstore": ["store", "serve"], "prefill": ["prefill", "serve"],
                  "decode": ["decode", "serve"], "router": ["router", "serve"]}


def expand(args: list[str], container: Container) -> list[str]:
    """$(VAR) as the kubelet expands it; an undefined VAR stays literal there, a bug here."""
    defined = container.env_names()

    def sub(m: re.Match[str]) -> str:
        name = m.group(1)
        assert name in defined, f"{container.where}: args use $({name}) but env has no {name}"
        return SAMPLE_ENV.get(name, f"value-of-{name}")

    return [VAR_REF.sub(sub, a) for a in args]


def kvserve_containers(manifest: Manifest) -> list[Container]:
    return [c for c in manifest.containers() if c.is_kvserve]


def test_base_configmap_is_the_checked_in_file(rendered: dict[str, Manifest]) -> None:
    assert rendered["base"].config_text() == (K8S / "base" / CONFIG_KEY).read_text()


def test_configmap_loads_with_kvserve_loader(manifest: Manifest, tmp_path: Path) -> None:
    _, cfg = manifest.config(tmp_path)
    assert isinstance(cfg, KVServeConfig)
    assert set(cfg.classes.ttl_s) >= {"agent", "chat"}
    assert cfg.blocks.reserve >= 1


def test_kvserve_config_check_accepts_configmap(manifest: Manifest, tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    path, _ = manifest.config(tmp_path)
    assert main(["config", "check", str(path)]) == 0
    assert f"{path}: ok" in capsys.readouterr().out


def test_config_check_would_catch_a_bad_configmap(rendered: dict[str, Manifest], tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text(rendered["cpu-demo"].config_text().replace('default = "chat"',
                                                              'default = "batch"'))
    assert main(["config", "check", str(bad)]) == 2
    assert "classes.default 'batch'" in capsys.readouterr().err


def test_every_kvserve_container_args_parse(manifest: Manifest) -> None:
    containers = kvserve_containers(manifest)
    assert containers, f"{manifest.target}: no kvserve containers"
    parser = build_parser()
    for c in containers:
        assert "command" not in c.spec, f"{c.where}: keep the image's kvserve entrypoint"
        args = expand(list(c.spec.get("args", ())), c)
        try:
            ns = parser.parse_args(args)
        except SystemExit as exc:
            pytest.fail(f"{c.where}: `kvserve {' '.join(args)}` does not parse (exit {exc})")
        assert getattr(ns, "_run", None) is not None, f"{c.where}: {args} is not a command"


def parsed(c: Container) -> object:
    return build_parser().parse_args(expand(list(c.spec["args"]), c))


@pytest.mark.parametrize("component", sorted(SERVE_COMMANDS))
def test_serve_args_match_ports_config_and_mounts(manifest: Manifest, component: str,
                                                  tmp_path: Path) -> None:
    c = manifest.main_container(component)
    assert c.spec["args"][:2] == SERVE_COMMANDS[component]
    ns = parsed(c)
    _, cfg = manifest.config(tmp_path)
    # --config names the ConfigMap's file where the pod mounts it.
    config_volume = next(v for v in pod_spec(c.workload)["volumes"]
                         if v.get("configMap", {}).get("name", "").startswith(CONFIG_MAP))
    assert Path(vars(ns)["config"]) == Path(c.mount(config_volume["name"]) or "") / CONFIG_KEY
    # The serving port is the container's grpc port and the config's port.
    port_of = {"kvstore": cfg.ports.kvstore, "prefill": cfg.ports.prefill,
               "decode": cfg.ports.decode, "router": cfg.ports.router_grpc}
    assert int(vars(ns)["port"]) == c.port("grpc") == port_of[component]
    # Redis credentials come from a mounted file (tests/k8s/test_secrets_wiring.py).
    assert vars(ns)["redis_url"] is None
    assert vars(ns)["redis_url_file"] == f"{c.mount('redis')}/url"
    assert vars(ns)["node"] == SAMPLE_ENV["NODE_NAME"]
    if component in ("prefill", "decode"):
        # Bind everywhere, publish the pod IP, dial the store on this node.
        assert vars(ns)["host"] == "0.0.0.0"
        assert vars(ns)["advertise_host"] == SAMPLE_ENV["POD_IP"]
        assert int(vars(ns)["metrics_port"]) == c.port("metrics") == cfg.ports.metrics
        host, _, port = vars(ns)["store"].rpartition(":")
        svc = manifest.get("Service", host)
        assert svc["spec"].get("internalTrafficPolicy") == "Local"
        store = manifest.main_container("kvstore")
        assert selector_matches({"matchLabels": svc["spec"]["selector"]},
                                pod_labels(store.workload))
        assert [p["port"] for p in svc["spec"]["ports"]] == [int(port)] == [store.port("grpc")]
        affinity = pod_spec(c.workload)["affinity"]["podAffinity"]
        term = affinity["requiredDuringSchedulingIgnoredDuringExecution"][0]
        assert term["topologyKey"] == "kubernetes.io/hostname"
        assert selector_matches(term["labelSelector"], pod_labels(store.workload))
    if component == "router":
        assert int(vars(ns)["http_port"]) == c.port("http") == cfg.ports.http
        assert vars(ns)["policy"] == cfg.router.policy
    if component == "kvstore":
        assert vars(ns)["host"] == SAMPLE_ENV["POD_IP"]     # bound and advertised
        assert int(vars(ns)["metrics_port"]) == c.port("metrics") == cfg.ports.metrics
        assert vars(ns)["g3_path"] == c.mount("g3") == cfg.tiers.g3_path


def test_model_fetch_init_containers_fetch_the_configured_model(manifest: Manifest,
                                                                tmp_path: Path) -> None:
    _, cfg = manifest.config(tmp_path)
    for component in ("router", "prefill", "decode"):
        main_c = manifest.main_container(component)
        inits = [c for c in manifest.containers() if c.init and c.workload is main_c.workload]
        assert [c.spec["args"][:2] for c in inits] == [["model", "fetch"]], main_c.where
        fetch = inits[0]
        assert fetch.spec["args"][2] == cfg.model.name
        env = {e["name"]: e.get("value") for e in fetch.spec["env"]}
        main_env = {e["name"]: e.get("value") for e in main_c.spec["env"]}
        # The engine looks for the model where the init container put it.
        assert env["KVSERVE_CACHE"] == main_env["KVSERVE_CACHE"] == fetch.mount("models")
        assert main_c.mount("models") == fetch.mount("models")


# SmolLM2-135M's KV layout (docs/engine.md: L30xH3xT64xD64): bytes of one block.
SMOLLM2_BLOCK_ELEMS = 30 * 2 * 3 * 64 * 64
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
RUNTIME_BYTES = 1536 * 2**20        # weights (0.5 GB fp32) + torch + the service


@pytest.mark.parametrize("component", ["prefill", "decode"])
def test_cpu_engine_kv_pool_fits_the_memory_limit(manifest: Manifest, component: str,
                                                  tmp_path: Path) -> None:
    _, cfg = manifest.config(tmp_path)
    if cfg.model.device != "cpu" or cfg.model.name != "smollm2":
        return  # a GPU pool lives in GPU memory
    c = manifest.main_container(component)
    blocks = int(vars(parsed(c))["num_blocks"])
    pool = blocks * SMOLLM2_BLOCK_ELEMS * DTYPE_BYTES[cfg.model.dtype]
    limit = quantity(c.spec["resources"]["limits"]["memory"])
    assert pool + RUNTIME_BYTES <= limit, f"{c.where}: {blocks} blocks = {pool:,} B > {limit}"


ENV_SOURCES = {"NODE_NAME": {"fieldRef": {"fieldPath": "spec.nodeName"}},
               "POD_IP": {"fieldRef": {"fieldPath": "status.podIP"}}}


def test_substituted_env_comes_from_the_right_place(manifest: Manifest) -> None:
    """The parse tests stand in sample values for $(VAR): check where VAR really
    comes from (the engines and their store must agree on the node name)."""
    for c in kvserve_containers(manifest):
        for e in c.spec.get("env", ()):
            if e["name"] in ENV_SOURCES:
                assert e["valueFrom"] == ENV_SOURCES[e["name"]], c.where
