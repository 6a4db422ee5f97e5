"""deploy/'s Kubernetes manifests against the code they run: every overlay renders (``kubectl
kustomize``), and what the pods are told agrees with what the programs read.

- every container command and exec probe parses with the real ``tierserve`` argument parsers;
- the gateway's ConfigMap loads through ``load_config`` with the pod's own mounted files and
  environment (generated CURVE keys, API key digests), every path it names inside a mount;
- ports, probe paths and scrape paths are the config's port and the real app's routes, answering;
- the workers dial every gateway replica at the worker link's port, with keys the gateways accept,
  and run the configured pool's settings;
- grace periods cover the drain; the liveness probe waits past the gateway's hang timeout;
- every Secret and ConfigMap a pod uses exists; the PDBs, the HPA and its metric are real.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tomllib
from pathlib import Path

import httpx
import pytest
import yaml

from gateway.app import create_app
from gateway.dispatch import Dispatcher
from gateway.state import Gateway
from gateway.tokenizer import BytePromptBuilder
from gateway.worker_procs import policies_arg, pool_args
from tests.deploy.kube import (
    DEPLOY,
    OVERLAYS,
    WITH_COMPONENTS,
    Obj,
    PodFiles,
    Rendered,
    container,
    container_env,
    copy_with_secrets,
    pod_spec,
    render,
    secret_data,
    selects,
)
from tests.wire.registers import cpu_register
from tierserve import cli as tierserve_cli
from wire.config import ServerConfig, load_config
from wire.curve import load_authorized_keys, load_key_pair
from wire.messages import Register
from worker import cli as worker_cli
from worker.cli_parser import parse_args as parse_worker_args

GATEWAY, WORKER = "tierserve-gateway", "tierserve-worker"


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return copy_with_secrets(tmp_path_factory.mktemp("deploy"))


@pytest.fixture(scope="module", params=[*OVERLAYS, WITH_COMPONENTS])
def rendered(request: pytest.FixtureRequest, tree: Path) -> Rendered:
    return Rendered(request.param, render(tree, request.param))


def parse(argv: list[str]) -> argparse.Namespace:
    """``tierserve ARGS`` through the parser ``tierserve`` itself would use; a parse error fails."""
    assert argv[0] == "tierserve", f"not a tierserve command: {argv}"
    try:
        if argv[1] == "serve":
            return tierserve_cli.serve_parser().parse_args(argv[2:])
        return parse_worker_args(argv[1:])
    except SystemExit:
        pytest.fail(f"tierserve does not accept {argv} (its error is above)")


def command_of(c: Obj) -> list[str]:
    return [*c.get("command", []), *c.get("args", [])]


def gateway_container(rendered: Rendered) -> tuple[Obj, Obj]:
    workload = rendered.get("StatefulSet", GATEWAY)
    return workload, container(workload, "gateway")


def worker_container(rendered: Rendered) -> tuple[Obj, Obj]:
    workload = rendered.get("StatefulSet", WORKER)
    return workload, container(workload, "worker")


def gateway_config(rendered: Rendered, root: Path) -> tuple[ServerConfig, PodFiles]:
    """The config a gateway pod loads: its --config file and CURVE paths read from its mounts (paths
    moved under ``root``), its environment from its Secrets."""
    workload, gateway = gateway_container(rendered)
    files = PodFiles(rendered, workload, gateway, root)
    path = parse(command_of(gateway)).config
    assert path is not None and files.is_mounted(path), f"--config {path} is in no volume of the pod"
    raw = tomllib.loads(files.host_path(path).read_text())["gateway"]
    env = container_env(rendered, gateway)
    moved = {}
    for key in ("curve_secret_key_file", "curve_authorized_keys_dir"):
        assert f"TIERSERVE_GATEWAY__{key.upper()}" not in env
        if raw.get(key) is not None:
            assert files.is_mounted(raw[key]), f"gateway.{key} = {raw[key]} is in no volume of the pod"
            moved[f"TIERSERVE_GATEWAY__{key.upper()}"] = str(files.host_path(raw[key]))
    return load_config(files.host_path(path), env={**env, **moved}), files


@pytest.fixture
def config(rendered: Rendered, tmp_path: Path) -> ServerConfig:
    return gateway_config(rendered, tmp_path / "gateway-pod")[0]


def named_port(c: Obj, name: str) -> int:
    ports = {p["name"]: p["containerPort"] for p in c.get("ports", [])}
    assert name in ports, f"container {c['name']} has no port {name!r}: {ports}"
    return int(ports[name])


def probe_port(c: Obj, port: int | str) -> int:
    return named_port(c, port) if isinstance(port, str) else port


def address_port(address: str) -> int:
    return int(address.rsplit(":", 1)[1])


# ---- rendering and the command lines --------------------------------------------------------------


def test_every_overlay_renders_the_whole_stack(rendered: Rendered) -> None:
    for kind, name in [
        ("StatefulSet", GATEWAY),
        ("StatefulSet", WORKER),
        ("Service", "tierserve"),
        ("Service", "tierserve-gateway-workers"),
        ("PodDisruptionBudget", GATEWAY),
        ("PodDisruptionBudget", WORKER),
        ("ConfigMap", "tierserve-config"),
    ]:
        rendered.get(kind, name)
    if rendered.overlay == WITH_COMPONENTS:
        rendered.get("HorizontalPodAutoscaler", WORKER)
        rendered.get("ServiceMonitor", GATEWAY)
    assert rendered.get("StatefulSet", GATEWAY)["spec"]["replicas"] >= 2, "gateways share the fleet"


def test_every_command_and_exec_probe_parses_with_the_real_cli(rendered: Rendered) -> None:
    for _, c in rendered.containers():
        parse(command_of(c))
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            if "exec" in c.get(probe, {}):
                parse(c[probe]["exec"]["command"])
    assert parse(command_of(gateway_container(rendered)[1])).no_workers, "workers run in their own pods"
    assert parse(command_of(worker_container(rendered)[1])).command == "worker"


def test_every_secret_and_config_map_a_pod_uses_exists(rendered: Rendered) -> None:
    for workload, c in rendered.containers():
        for volume in pod_spec(workload).get("volumes", []):
            if "secret" in volume:
                data = secret_data(rendered.get("Secret", volume["secret"]["secretName"]))
                assert data, f"{volume['secret']['secretName']} is empty"
                for item in volume["secret"].get("items", []):
                    assert item["key"] in data
            if "configMap" in volume:
                rendered.get("ConfigMap", volume["configMap"]["name"])
        container_env(rendered, c)  # resolves every envFrom / secretKeyRef / configMapKeyRef


# ---- the gateway --------------------------------------------------------------------------------


def test_the_config_map_loads_with_the_pods_own_files_and_environment(
    rendered: Rendered, config: ServerConfig
) -> None:
    # load_config read the CURVE key pair and the authorized keys from the mounted Secrets, and took
    # the TIERSERVE_* variables of the pod's Secret as config keys (an unknown one would have failed).
    assert config.gateway.curve_secret_key_file is not None
    assert config.gateway.require_api_key
    assert config.gateway.cache_salt_secret, "gateways sharing a fleet need one cache salt secret"
    assert any(t.api_key_sha256 or t.api_keys for t in config.tenants)


def test_ports_and_probe_paths_are_the_configs_and_the_apps(rendered: Rendered, config: ServerConfig) -> None:
    workload, gateway = gateway_container(rendered)
    http = named_port(gateway, "http")
    assert http == config.gateway.port
    ready, alive = gateway["readinessProbe"]["httpGet"], gateway["livenessProbe"]["httpGet"]
    assert probe_port(gateway, ready["port"]) == probe_port(gateway, alive["port"]) == http
    annotations = workload["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert int(annotations["prometheus.io/port"]) == http
    service = rendered.get("Service", "tierserve")
    assert selects(service["spec"]["selector"], workload["spec"]["template"]["metadata"]["labels"])
    assert [probe_port(gateway, p["targetPort"]) for p in service["spec"]["ports"]] == [http]

    pool = config.models.pools[0]
    answers = asyncio.run(
        ask_app(config, pool.model_name, [ready["path"], alive["path"], annotations["prometheus.io/path"]])
    )
    before, after = answers[ready["path"]]
    assert (before.status_code, after.status_code) == (503, 200), "/ready: 503 without a worker, 200 with"
    assert [r.status_code for r in answers[alive["path"]]] == [200, 200]
    assert "tierserve_admission_queue_length" in answers[annotations["prometheus.io/path"]][1].text


async def ask_app(config: ServerConfig, model: str, paths: list[str]) -> dict[str, list[httpx.Response]]:
    """GET each path of the real app, before and after a worker of ``model`` registers."""
    dispatcher = Dispatcher("tcp://127.0.0.1:0")
    gateway = Gateway(dispatcher, config, {model: BytePromptBuilder()}, 0)
    answers: dict[str, list[httpx.Response]] = {path: [] for path in paths}
    try:
        transport = httpx.ASGITransport(app=create_app(gateway))
        async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as http:
            for registered in (False, True):
                if registered:
                    dispatcher.registry.on_register(register(model), 0.0)
                    gateway.admissions(model)  # what a first request does: the model's queues exist
                for path in paths:
                    answers[path].append(await http.get(path))
    finally:
        await dispatcher.close()
    return answers


def register(model: str) -> Register:
    return cpu_register(f"{WORKER}-0", model=model, max_model_len=2048, vocab_size=300)


def test_the_grace_period_covers_the_drain(rendered: Rendered, config: ServerConfig) -> None:
    workload, gateway = gateway_container(rendered)
    pre_stop = gateway["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    grace = pod_spec(workload)["terminationGracePeriodSeconds"]
    # SIGTERM comes after preStop; in-flight requests then get drain_timeout_s, and exiting takes a moment.
    assert grace > float(pre_stop[1]) + config.gateway.drain_timeout_s


# ---- the workers and their link -----------------------------------------------------------------


def test_workers_dial_every_gateway_replica_at_the_worker_link(
    rendered: Rendered, config: ServerConfig
) -> None:
    gateways, gateway = gateway_container(rendered)
    link = rendered.get("Service", gateways["spec"]["serviceName"])
    assert link["spec"]["clusterIP"] == "None", "each gateway pod needs its own DNS name"
    assert link["spec"]["publishNotReadyAddresses"], "a gateway is not Ready until a worker dialled it"
    assert selects(link["spec"]["selector"], gateways["spec"]["template"]["metadata"]["labels"])
    port = address_port(config.gateway.worker_address)
    assert port == named_port(gateway, "workers")
    assert [probe_port(gateway, p["targetPort"]) for p in link["spec"]["ports"]] == [port]
    assert [p["port"] for p in link["spec"]["ports"]] == [port]

    _, worker = worker_container(rendered)
    args = parse(command_of(worker))
    name, service = gateways["metadata"]["name"], link["metadata"]["name"]
    expected = [f"tcp://{name}-{i}.{service}:{port}" for i in range(gateways["spec"]["replicas"])]
    assert worker_cli._addresses(args.connect) == expected


def test_worker_keys_are_the_ones_the_gateways_accept(rendered: Rendered, tmp_path: Path) -> None:
    config, _ = gateway_config(rendered, tmp_path / "gateway-pod")
    assert config.gateway.curve_secret_key_file and config.gateway.curve_authorized_keys_dir
    gateway_keys = load_key_pair(config.gateway.curve_secret_key_file)
    authorized = load_authorized_keys(config.gateway.curve_authorized_keys_dir)

    workload, worker = worker_container(rendered)
    files = PodFiles(rendered, workload, worker, tmp_path / "worker-pod")
    args = parse(command_of(worker))
    for path in [args.curve_secret_key_file, *args.curve_server_key_file]:
        assert files.is_mounted(path), f"{path} is in no volume of the worker pod"
    args.curve_secret_key_file = str(files.host_path(args.curve_secret_key_file))
    args.curve_server_key_file = [str(files.host_path(p)) for p in args.curve_server_key_file]
    keys = worker_cli._curve_keys(args, len(worker_cli._addresses(args.connect)))
    assert keys is not None
    assert set(keys.server_keys) == {gateway_keys.public_key}
    assert keys.key_pair.public_key in authorized
    assert b"secret-key" not in b"".join(
        secret_data(rendered.get("Secret", "tierserve-authorized-workers")).values()
    )


def test_workers_run_the_configured_pool(rendered: Rendered, config: ServerConfig) -> None:
    _, worker = worker_container(rendered)
    args = parse(command_of(worker))
    (pool,) = config.models.pools
    assert args.served_name == pool.model_name
    # What serve would pass this pool's workers (gateway/worker_procs.py), parsed by the same parser.
    serves = parse(["tierserve", "worker", "--connect", "tcp://x:1", "--model", pool.path, *pool_args(pool)])
    assert worker_cli._engine_config(args) == worker_cli._engine_config(serves)
    assert (args.context_classes.split(",") if args.context_classes else []) == list(pool.context_classes)
    # No --policies: the worker takes the config defaults (worker/cli.py _policies), as JSON carries them.
    defaults = json.dumps(ServerConfig().policies.worker_selections())
    given = json.loads(args.policies or defaults)
    assert given == json.loads(policies_arg(config)[1]), "the workers' policies differ from [policies]"
    env = container_env(rendered, worker)
    assert args.worker_id == "$(POD_NAME)" and "POD_NAME" in env, "stable ids: the pod's own name"


def test_the_liveness_probe_checks_the_workers_own_file_past_the_hang_timeout(
    rendered: Rendered, config: ServerConfig
) -> None:
    workload, worker = worker_container(rendered)
    args = parse(command_of(worker))
    files = PodFiles(rendered, workload, worker, Path("/nonexistent"))
    assert files.is_mounted(args.liveness_file), "the probe runs in the same container: a shared volume"
    volume = next(m["name"] for m in worker["volumeMounts"] if args.liveness_file.startswith(m["mountPath"]))
    assert "emptyDir" in next(v for v in pod_spec(workload)["volumes"] if v["name"] == volume)
    for kind in ("startupProbe", "livenessProbe"):
        probe = parse(worker[kind]["exec"]["command"])
        assert probe.command == "probe" and probe.liveness_file == args.liveness_file
        # Longer than the gateway's own hang detection, which moves the requests first.
        assert probe.max_age_s >= config.gateway.hang_timeout_s
        assert worker[kind]["periodSeconds"] < probe.max_age_s
    startup = worker["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 300, "room to load and calibrate"


def test_workers_are_asked_for_gpus_only_in_the_gpu_overlays(rendered: Rendered) -> None:
    _, worker = worker_container(rendered)
    limits = worker["resources"].get("limits", {})
    if rendered.overlay.startswith("gpu"):
        assert limits["nvidia.com/gpu"] == worker["resources"]["requests"]["nvidia.com/gpu"] == 1
    else:
        assert "nvidia.com/gpu" not in limits
    _, gateway = gateway_container(rendered)
    assert "nvidia.com/gpu" not in gateway["resources"].get("limits", {})


def test_images_name_a_dockerfile(rendered: Rendered) -> None:
    tags = {c["image"].rsplit(":", 1)[1] for _, c in rendered.containers()}
    assert len(tags) == 1, "gateway and worker run one image"
    assert (DEPLOY / "docker" / f"{tags.pop()}.Dockerfile").exists()


# ---- disruption, scraping, scaling --------------------------------------------------------------


def test_each_workload_has_a_disruption_budget_selecting_its_pods(rendered: Rendered) -> None:
    for workload in rendered.workloads():
        labels = workload["spec"]["template"]["metadata"]["labels"]
        budgets = [
            b
            for b in rendered.all("PodDisruptionBudget")
            if selects(b["spec"]["selector"]["matchLabels"], labels)
        ]
        assert len(budgets) == 1, workload["metadata"]["name"]
        assert budgets[0]["spec"].get("maxUnavailable", 0) >= 1 or budgets[0]["spec"].get("minAvailable")


def test_service_monitor_and_autoscaler_name_real_ports_and_metrics(
    rendered: Rendered, config: ServerConfig
) -> None:
    if rendered.overlay != WITH_COMPONENTS:
        assert not rendered.all("HorizontalPodAutoscaler") and not rendered.all("ServiceMonitor")
        return
    gateways, gateway = gateway_container(rendered)
    labels = gateways["spec"]["template"]["metadata"]["labels"]
    monitor = rendered.get("ServiceMonitor", GATEWAY)
    (service,) = [
        s
        for s in rendered.all("Service")
        if selects(monitor["spec"]["selector"]["matchLabels"], s["metadata"].get("labels", {}))
        and s["spec"].get("clusterIP") != "None"
    ]
    assert selects(service["spec"]["selector"], labels)
    (endpoint,) = monitor["spec"]["endpoints"]
    (port,) = [p for p in service["spec"]["ports"] if p["name"] == endpoint["port"]]
    assert probe_port(gateway, port["targetPort"]) == config.gateway.port

    hpa = rendered.get("HorizontalPodAutoscaler", WORKER)
    target = hpa["spec"]["scaleTargetRef"]
    rendered.get(target["kind"], target["name"])
    assert "replicas" not in rendered.get("StatefulSet", WORKER)["spec"], "the HPA owns the replicas"
    (metric,) = hpa["spec"]["metrics"]
    name, selector = metric["external"]["metric"]["name"], metric["external"]["metric"]["selector"]
    adapter = yaml.safe_load(
        (DEPLOY / "components" / "autoscaling" / "prometheus-adapter-values.yaml").read_text()
    )
    (rule,) = [r for r in adapter["rules"]["external"] if r["name"]["as"] == name]
    series = rule["seriesQuery"].split("{")[0].strip("'\" ")
    assert selector["matchLabels"]["model"] in {p.model_name for p in config.models.pools}
    scraped = asyncio.run(ask_app(config, selector["matchLabels"]["model"], [endpoint["path"]]))
    text = scraped[endpoint["path"]][1].text
    assert f"# TYPE {series} gauge" in text, f"the gateway exports no gauge {series}"
    assert any(line.startswith(f"{series}{{") and 'model="' in line for line in text.splitlines())
