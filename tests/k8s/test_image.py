"""The image the manifests run: a multi-stage build whose final stage runs as
the same non-root user the pods demand, with kvserve as its entrypoint, and
a build context that keeps everything pip needs and nothing else."""

from __future__ import annotations

import fnmatch
import json
import re
import tomllib
from dataclasses import dataclass, field

from tests.k8s.manifests import REPO, Manifest, pod_spec

DOCS = REPO / "docs" / "deploy-kubernetes.md"


@dataclass(slots=True)
class Stage:
    base: str
    name: str
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def last(self, op: str) -> str | None:
        values = [v for o, v in self.instructions if o == op]
        return values[-1] if values else None


def dockerfile_stages() -> list[Stage]:
    text = re.sub(r"\\\n", " ", (REPO / "Dockerfile").read_text())
    stages: list[Stage] = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        op, _, rest = line.partition(" ")
        op = op.upper()
        if op == "FROM":
            parts = rest.split()
            stages.append(Stage(parts[0], parts[2] if len(parts) > 2 else ""))
        elif stages:
            stages[-1].instructions.append((op, rest.strip()))
    return stages


def test_dockerfile_is_multi_stage_and_ends_non_root() -> None:
    stages = dockerfile_stages()
    assert len(stages) >= 2 and all(s.name for s in stages)
    final = stages[-1]
    assert any(op == "COPY" and v.startswith(f"--from={stages[0].name} ")
               for op, v in final.instructions), "final stage must copy the built venv"
    user = final.last("USER")
    assert user is not None and re.fullmatch(r"\d+(:\d+)?", user), f"USER {user!r} not numeric"
    assert int(user.split(":")[0]) != 0
    assert json.loads(final.last("ENTRYPOINT") or "null") == ["kvserve"]
    # No compiler or build tooling in the image that runs.
    assert not [v for op, v in final.instructions if op == "RUN" and "gcc" in v]


def test_torch_comes_from_a_chosen_index_not_the_default() -> None:
    build = dockerfile_stages()[0]
    torch_runs = [v for op, v in build.instructions if op == "RUN" and "torch" in v]
    assert torch_runs and all("--index-url" in v and "TORCH_INDEX_URL" in v for v in torch_runs)
    args = dict(v.split("=", 1) for op, v in build.instructions if op == "ARG" and "=" in v)
    assert args["TORCH_INDEX_URL"].endswith("/cpu")


def test_pods_run_as_the_image_user(manifest: Manifest) -> None:
    uid = int((dockerfile_stages()[-1].last("USER") or "").split(":")[0])
    for c in manifest.containers():
        if c.is_kvserve:
            pod = pod_spec(c.workload).get("securityContext", {})
            assert c.spec.get("securityContext", {}).get("runAsUser", pod.get("runAsUser")) == uid


def _ignored(path: str, patterns: list[str]) -> bool:
    ignored = False
    for pat in patterns:
        negate = pat.startswith("!")
        pat = pat.lstrip("!").rstrip("/")
        if fnmatch.fnmatch(path, pat) or fnmatch.fnmatch(path, pat.removeprefix("**/")):
            ignored = not negate
    return ignored


def test_dockerignore_keeps_what_pip_needs_and_drops_the_rest() -> None:
    patterns = [ln.strip() for ln in (REPO / ".dockerignore").read_text().splitlines()
                if ln.strip() and not ln.startswith("#")]
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    packages = [p.rstrip("*") for p in project["tool"]["setuptools"]["packages"]["find"]["include"]]
    needed = ["pyproject.toml", "setup.py", project["project"]["readme"], *packages]
    assert [p for p in needed if _ignored(p, patterns)] == []
    for heavy in (".git", "tests", "docs", "k8s", ".venv", "engine/__pycache__"):
        assert _ignored(heavy, patterns), f"{heavy} would be sent to the docker daemon"


def test_deploy_doc_covers_every_overlay_and_component() -> None:
    text = DOCS.read_text()
    k8s = REPO / "k8s"
    for kind in ("overlays", "components"):
        for d in sorted(p for p in (k8s / kind).iterdir() if p.is_dir()):
            assert f"k8s/{kind}/{d.name}" in text or f"{kind}/{d.name}" in text, d
    for must in ("operators.md", "REDIS_URL", "14.4 TB", "30.73 TB", "StatefulSet",
                 "kubectl kustomize"):
        assert must in text, must
