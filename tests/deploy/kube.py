"""deploy/ rendered the way ``kubectl apply -k`` would, and a pod's files laid out on this disk.

``render(overlay, tmp)`` copies deploy/ into ``tmp``, makes its Secrets with the real
deploy/secrets/generate.sh (``tierserve keys generate`` inside) and runs ``kubectl kustomize``;
``PodFiles`` writes what a container's volumeMounts would show it (ConfigMap and Secret keys, empty
dirs) under a root folder, so a path the config names can be opened as the container would.
"""

from __future__ import annotations

import base64
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
OVERLAYS = sorted(p.name for p in (DEPLOY / "overlays").iterdir() if (p / "kustomization.yaml").exists())
COMPONENTS = sorted(p.name for p in (DEPLOY / "components").iterdir() if (p / "kustomization.yaml").exists())
# An overlay a user would write: gpu with every optional component (ServiceMonitor, HPA).
WITH_COMPONENTS = "gpu+components"

Obj = dict[str, Any]


def kubectl() -> str:
    found = shutil.which("kubectl")
    if found is None:
        pytest.skip("kubectl is not installed: the manifests cannot be rendered (kubectl kustomize)")
    return found


def copy_with_secrets(tmp: Path) -> Path:
    """deploy/ copied into ``tmp``, with the Secrets' files made by the real generate.sh."""
    tree = tmp / "deploy"
    shutil.copytree(DEPLOY, tree, ignore=shutil.ignore_patterns("secrets"), dirs_exist_ok=False)
    (tree / "base" / "secrets").mkdir()
    shutil.copytree(DEPLOY / "secrets", tree / "secrets")
    tierserve = Path(sys.executable).parent / "tierserve"
    subprocess.run(
        ["sh", str(tree / "secrets" / "generate.sh")],
        check=True,
        capture_output=True,
        env={"TIERSERVE": str(tierserve), "PATH": "/usr/bin:/bin"},
    )
    components = tree / "overlays" / WITH_COMPONENTS
    components.mkdir()
    (components / "kustomization.yaml").write_text(
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\nresources: [../gpu]\n"
        f"components: [{', '.join(f'../../components/{c}' for c in COMPONENTS)}]\n"
    )
    return tree


def render(tree: Path, overlay: str) -> list[Obj]:
    result = subprocess.run(
        [kubectl(), "kustomize", str(tree / "overlays" / overlay)], capture_output=True, text=True
    )
    assert result.returncode == 0, f"kubectl kustomize overlays/{overlay} failed: {result.stderr}"
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


@dataclass
class Rendered:
    overlay: str
    objects: list[Obj]

    def all(self, kind: str) -> list[Obj]:
        return [o for o in self.objects if o["kind"] == kind]

    def get(self, kind: str, name: str) -> Obj:
        """The object of ``kind`` whose name is ``name`` (or, for a generated one, ``name-<hash>``)."""
        found = [o for o in self.all(kind) if _is_named(o, name)]
        assert len(found) == 1, f"{self.overlay}: {len(found)} {kind} objects named {name!r}"
        return found[0]

    def workloads(self) -> list[Obj]:
        return self.all("StatefulSet") + self.all("Deployment")

    def containers(self) -> Iterator[tuple[Obj, Obj]]:
        """(workload, container) for every container of every workload."""
        for workload in self.workloads():
            spec = workload["spec"]["template"]["spec"]
            for container in spec.get("initContainers", []) + spec["containers"]:
                yield workload, container


def _is_named(obj: Obj, name: str) -> bool:
    actual = obj["metadata"]["name"]
    return bool(actual == name or (actual.startswith(f"{name}-") and len(actual) == len(name) + 11))


def pod_spec(workload: Obj) -> Obj:
    spec: Obj = workload["spec"]["template"]["spec"]
    return spec


def container(workload: Obj, name: str) -> Obj:
    found = [c for c in pod_spec(workload)["containers"] if c["name"] == name]
    assert len(found) == 1, f"{workload['metadata']['name']}: no container {name!r}"
    return found[0]


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(key) == value for key, value in selector.items())


def secret_data(secret: Obj) -> dict[str, bytes]:
    data = {key: base64.b64decode(value) for key, value in secret.get("data", {}).items()}
    data.update({key: value.encode() for key, value in secret.get("stringData", {}).items()})
    return data


def config_map_data(config_map: Obj) -> dict[str, bytes]:
    data = {key: value.encode() for key, value in config_map.get("data", {}).items()}
    data.update({key: base64.b64decode(v) for key, v in config_map.get("binaryData", {}).items()})
    return data


class PodFiles:
    """A container's mounted volumes, written under ``root`` as the kubelet would show them."""

    def __init__(self, rendered: Rendered, workload: Obj, container: Obj, root: Path) -> None:
        self.root = root
        self.mount_paths: list[PurePosixPath] = []
        volumes = {v["name"]: v for v in pod_spec(workload).get("volumes", [])}
        for mount in container.get("volumeMounts", []):
            volume = volumes[mount["name"]]
            where = PurePosixPath(mount["mountPath"])
            self.mount_paths.append(where)
            files = _volume_files(rendered, volume)
            if "subPath" in mount:
                files = {"": files[mount["subPath"]]} if files is not None else None
            target = self.host_path(where)
            if files is None:  # emptyDir
                target.mkdir(parents=True, exist_ok=True)
                continue
            for relative, content in files.items():
                path = target / relative if relative else target
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(content)

    def host_path(self, container_path: str | PurePosixPath) -> Path:
        return self.root / PurePosixPath(container_path).relative_to("/")

    def is_mounted(self, container_path: str) -> bool:
        path = PurePosixPath(container_path)
        return any(path == mount or mount in path.parents for mount in self.mount_paths)


def _volume_files(rendered: Rendered, volume: Obj) -> dict[str, bytes] | None:
    """A volume's files by relative path; None for an emptyDir."""
    if "emptyDir" in volume:
        return None
    if "configMap" in volume:
        source = volume["configMap"]
        data = config_map_data(rendered.get("ConfigMap", source["name"]))
    elif "secret" in volume:
        source = volume["secret"]
        data = secret_data(rendered.get("Secret", source["secretName"]))
    else:
        raise AssertionError(f"volume {volume['name']}: a kind these checks do not know: {volume}")
    items = source.get("items")
    if items is None:
        return data
    return {item["path"]: data[item["key"]] for item in items}


def container_env(rendered: Rendered, container: Obj) -> dict[str, str]:
    """The container's environment as its process sees it (Secrets and ConfigMaps resolved; fieldRef
    values as a placeholder)."""
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        if "secretRef" in source:
            data = secret_data(rendered.get("Secret", source["secretRef"]["name"]))
        else:
            data = config_map_data(rendered.get("ConfigMap", source["configMapRef"]["name"]))
        env.update({key: value.decode() for key, value in data.items()})
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = var["value"]
            continue
        ref = var["valueFrom"]
        if "secretKeyRef" in ref:
            key_ref = ref["secretKeyRef"]
            env[var["name"]] = secret_data(rendered.get("Secret", key_ref["name"]))[key_ref["key"]].decode()
        elif "configMapKeyRef" in ref:
            key_ref = ref["configMapKeyRef"]
            data = config_map_data(rendered.get("ConfigMap", key_ref["name"]))
            env[var["name"]] = data[key_ref["key"]].decode()
        else:
            env[var["name"]] = f"<{var['name']}>"  # fieldRef / resourceFieldRef: known in the pod only
    return env
