"""The Kubernetes manifests (deploy/k8s): every object validates offline against the Kubernetes 1.37 schemas that
kubernetes-validate bundles (strict: an unknown field fails), every inferd command line parses with inferd's own
parser, and the pieces agree: one Redis, one worker secret, the keys mounted where --keys reads them, probes on the
served port, grace periods that cover the drain, an HPA on inferd_desired_workers within the gateway's bounds."""

from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.timeout(120)

K8S_VERSION = "1.37.0"  # a version kubernetes-validate==1.37.0 ships schemas for: nothing is fetched


def manifest_files(repo: Path) -> list[Path]:
    files = sorted((repo / "deploy" / "k8s").rglob("*.yaml"))
    assert files, "no manifests under deploy/k8s"
    return files


@pytest.fixture(scope="module")
def objects(repo) -> list[tuple[str, dict]]:
    """(file, object) for every object of every manifest."""
    out = []
    for path in manifest_files(repo):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                out.append((str(path.relative_to(repo)), doc))
    return out


def find(objects, kind: str, name: str) -> dict:
    matches = [o for _, o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(matches) == 1, f"{len(matches)} {kind} named {name}"
    return matches[0]


def test_every_object_validates_offline(objects):
    from kubernetes_validate import utils

    assert K8S_VERSION in utils.all_versions()
    failures = []
    for path, obj in objects:
        try:
            utils.validate(obj, K8S_VERSION, strict=True)
        except utils.ValidationError as e:
            failures.append(f"{path}: {obj['kind']}/{obj['metadata']['name']}: {'.'.join(map(str, e.path))}: "
                            f"{e.message}")
        except utils.SchemaNotFoundError as e:  # the CLI only warns: an object nothing checked is a failure here
            failures.append(f"{path}: {obj['kind']}: {e.message}")
    assert not failures, "\n".join(failures)
    kinds = {o["kind"] for _, o in objects}
    assert {"Deployment", "Service", "PodDisruptionBudget", "HorizontalPodAutoscaler", "ConfigMap"} <= kinds


def test_the_validator_rejects_an_unknown_field(objects):
    """The check above can fail: strict validation of a misspelled field."""
    from kubernetes_validate import utils

    worker = copy.deepcopy(find(objects, "Deployment", "inferd-worker"))
    worker["spec"]["template"]["spec"]["terminationGracePeriod"] = 30
    with pytest.raises(utils.ValidationError):
        utils.validate(worker, K8S_VERSION, strict=True)


# ---- the inferd containers -----------------------------------------------------------------------------------

POD_IP = "10.1.2.3"


def expand(text: str, env: list[dict]) -> str:
    """Kubernetes' $(VAR) expansion of container args from the container's env. An undefined $(VAR) fails: the
    container would get it literally."""
    values = {}
    for var in env:
        if "value" in var:
            values[var["name"]] = var["value"]
        elif var.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == "status.podIP":
            values[var["name"]] = POD_IP

    def sub(m: re.Match) -> str:
        assert m.group(1) in values, f"$({m.group(1)}) is not defined in the container's env"
        return values[m.group(1)]

    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", sub, text)


def inferd_containers(objects):
    """(deployment, pod spec, container) of every container running an inferd image."""
    for _, obj in objects:
        if obj["kind"] != "Deployment":
            continue
        pod = obj["spec"]["template"]["spec"]
        for c in pod["containers"]:
            if c["image"].split("/")[-1].startswith("inferd"):
                yield obj, pod, c


@pytest.fixture(scope="module")
def parsed(objects, parse_inferd) -> dict[str, tuple[dict, dict, object]]:
    """Deployment name -> (pod spec, container, the Namespace inferd's parser makes of its args)."""
    out = {}
    for deployment, pod, c in inferd_containers(objects):
        assert "command" not in c, "the image's entrypoint (docker-entrypoint.sh) runs inferd: give args only"
        argv = [expand(str(a), c.get("env", [])) for a in c["args"]]
        out[deployment["metadata"]["name"]] = (pod, c, parse_inferd(argv))
    return out


def test_every_inferd_command_line_parses(parsed, parse_inferd):
    """parse_inferd fails on a flag inferd does not have or a value it refuses; these are its two commands here."""
    with pytest.raises(AssertionError, match="unrecognized arguments: --shutdown-grace-s"):
        parse_inferd(["worker", "--shutdown-grace-s", "30"])
    with pytest.raises(AssertionError, match="invalid choice"):
        parse_inferd(["gateway", "--fairness", "lottery"])
    assert {name: ns.command for name, (_, _, ns) in parsed.items()} == {"inferd-gateway": "gateway",
                                                                          "inferd-worker": "worker"}


def mounted_secret(pod: dict, container: dict, path: str) -> str:
    """The Secret a file path of the container comes from (its volume mount's), or AssertionError."""
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    for mount in container.get("volumeMounts", []):
        if path.startswith(mount["mountPath"].rstrip("/") + "/"):
            secret = volumes[mount["name"]].get("secret")
            assert secret, f"{path} is on volume {mount['name']}, not a Secret"
            key = path[len(mount["mountPath"].rstrip("/")) + 1:]
            items = secret.get("items")
            assert items is None or key in {i["path"] for i in items}
            return secret["secretName"]
    raise AssertionError(f"{path} is on no volume mount of {container['name']}")


def test_gateway_and_workers_share_one_redis_and_one_worker_secret(parsed, objects):
    gw_pod, gw, gateway = parsed["inferd-gateway"]
    wk_pod, wk, worker = parsed["inferd-worker"]
    assert gateway.redis == worker.register
    m = re.fullmatch(r"redis://([a-z0-9-]+):(\d+)/\d+", gateway.redis)
    assert m, gateway.redis
    service = find(objects, "Service", m.group(1))
    assert int(m.group(2)) in {p["port"] for p in service["spec"]["ports"]}
    assert gateway.worker_secret is None and worker.worker_secret is None  # never on the command line (ps)
    assert mounted_secret(gw_pod, gw, gateway.worker_secret_file) == \
        mounted_secret(wk_pod, wk, worker.worker_secret_file)


def test_gateway_requires_keys_from_a_mounted_secret(parsed):
    """Bound to 0.0.0.0, the gateway refuses to start without keys (inferd/cli/server.py run_http_server)."""
    pod, c, gateway = parsed["inferd-gateway"]
    assert gateway.host == "0.0.0.0" and gateway.api_key is None
    assert gateway.keys is not None
    mounted_secret(pod, c, gateway.keys)


def test_workers_listen_and_advertise_the_pod_address_on_one_gpu(parsed):
    from inferd.worker.address import parse_address

    pod, c, worker = parsed["inferd-worker"]
    host, port = parse_address(worker.listen, allow_any_port=True)
    assert host == "0.0.0.0"
    assert parse_address(worker.advertise) == (POD_IP, port)
    assert worker.device == "cuda"
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert port in {p["containerPort"] for p in c["ports"]}


def probe_port(container: dict, probe: dict) -> int:
    action = probe.get("httpGet") or probe.get("tcpSocket")
    port = action["port"]
    if isinstance(port, str):
        port = next(p["containerPort"] for p in container["ports"] if p["name"] == port)
    return port


def test_probes_and_the_service_reach_the_served_port(parsed, objects):
    from inferd.worker.address import parse_address

    _, c, gateway = parsed["inferd-gateway"]
    assert c["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert c["livenessProbe"]["httpGet"]["path"] == "/health"
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert probe_port(c, c[probe]) == gateway.port, probe
    service = find(objects, "Service", "inferd-gateway")
    for port in service["spec"]["ports"]:
        target = port["targetPort"]
        assert (target if isinstance(target, int) else probe_port(c, {"tcpSocket": {"port": target}})) == \
            gateway.port
    _, w, worker = parsed["inferd-worker"]
    listen_port = parse_address(worker.listen, allow_any_port=True)[1]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert probe_port(w, w[probe]) == listen_port, probe


def prestop_seconds(container: dict) -> float:
    pre = container.get("lifecycle", {}).get("preStop")
    if pre is None:
        return 0.0
    if "sleep" in pre:
        return float(pre["sleep"]["seconds"])
    command = pre["exec"]["command"]
    assert command[0] == "sleep" and len(command) == 2, command
    return float(command[1])


@pytest.mark.parametrize("name", ["inferd-gateway", "inferd-worker"])
def test_the_termination_grace_period_covers_the_drain(parsed, name):
    """SIGTERM comes after the preStop hook; then --shutdown-grace for the running requests, then the hand-back and
    the exit. Kubernetes kills the pod terminationGracePeriodSeconds after it started, preStop included."""
    pod, c, ns = parsed[name]
    needed = prestop_seconds(c) + ns.shutdown_grace + 10
    assert pod["terminationGracePeriodSeconds"] >= needed, (name, pod["terminationGracePeriodSeconds"], needed)


def test_the_gateway_drains_behind_its_service(parsed):
    """The gateway's preStop waits for the Service to drop the pod before SIGTERM starts its drain."""
    _, c, gateway = parsed["inferd-gateway"]
    assert prestop_seconds(c) >= 5
    assert gateway.shutdown_grace > 5  # longer than the default: a gateway's cut streams cannot move elsewhere


def test_the_hpa_scales_the_workers_on_inferd_desired_workers(parsed, objects):
    _, _, gateway = parsed["inferd-gateway"]
    hpa = find(objects, "HorizontalPodAutoscaler", "inferd-worker")["spec"]
    target = hpa["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", "inferd-worker")
    assert "replicas" not in find(objects, "Deployment", "inferd-worker")["spec"], "the HPA owns the count"
    [metric] = hpa["metrics"]
    assert metric["type"] == "External"
    assert metric["external"]["metric"]["name"] == "inferd_desired_workers"
    assert metric["external"]["target"] == {"type": "AverageValue", "averageValue": "1"}  # replicas = the metric
    assert gateway.worker_capacity is not None, "the gateway exports no autoscaler without --worker-capacity"
    assert (hpa["minReplicas"], hpa["maxReplicas"]) == (gateway.min_workers, gateway.max_workers)
    # prometheus-adapter serves the metric under that name
    adapter = find(objects, "ConfigMap", "prometheus-adapter")
    rules = yaml.safe_load(adapter["data"]["config.yaml"])["externalRules"]
    [rule] = [r for r in rules if r["name"]["as"] == "inferd_desired_workers"]
    assert "inferd_desired_workers" in rule["seriesQuery"] and re.search(r"inferd_desired_workers", rule["name"]
                                                                         ["matches"])
    assert "<<.Series>>" in rule["metricsQuery"] and "<<.LabelMatchers>>" in rule["metricsQuery"]


def test_selectors_match_their_pods(objects):
    deployments = [o for _, o in objects if o["kind"] == "Deployment"]
    for d in deployments:
        labels = d["spec"]["template"]["metadata"]["labels"]
        assert d["spec"]["selector"]["matchLabels"].items() <= labels.items(), d["metadata"]["name"]
    for _, o in objects:
        if o["kind"] == "Service":
            selector = o["spec"]["selector"].items()
        elif o["kind"] == "PodDisruptionBudget":
            selector = o["spec"]["selector"]["matchLabels"].items()
        else:
            continue
        matched = [d for d in deployments if selector <= d["spec"]["template"]["metadata"]["labels"].items()]
        assert len(matched) == 1, f"{o['kind']}/{o['metadata']['name']} selects {len(matched)} Deployments"
    pdbs = {o["metadata"]["name"] for _, o in objects if o["kind"] == "PodDisruptionBudget"}
    assert {"inferd-gateway", "inferd-worker"} <= pdbs


def test_inferd_pods_run_as_the_images_non_root_user(objects, repo):
    uids = {re.search(r"^USER (\d+)", (repo / name).read_text(), re.M).group(1)
            for name in ("Dockerfile", "deploy/Dockerfile.cuda")}
    assert len(uids) == 1, uids
    for _deployment, pod, c in inferd_containers(objects):
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert str(pod["securityContext"]["runAsUser"]) in uids
        assert c["securityContext"]["allowPrivilegeEscalation"] is False


# ---- secrets and who reaches what ----------------------------------------------------------------------------

def env_secret(container: dict, name: str) -> dict:
    """The secretKeyRef an env variable of the container comes from (AssertionError if none)."""
    [var] = [v for v in container.get("env", []) if v["name"] == name] or [None]
    assert var is not None, f"{container['name']} has no env {name}"
    ref = var.get("valueFrom", {}).get("secretKeyRef")
    assert ref, f"{container['name']}'s {name} does not come from a Secret"
    return ref


def pod_labels(objects, deployment: str) -> dict:
    return find(objects, "Deployment", deployment)["spec"]["template"]["metadata"]["labels"]


def test_redis_asks_for_a_password_that_gateways_and_workers_get_from_its_secret(parsed, objects):
    """Whoever can write to Redis can register a worker: it has requirepass, from a Secret, and the inferd pods
    get it from the same Secret as INFERD_REDIS_PASSWORD (never on their command line: the URLs carry none)."""
    pod = find(objects, "Deployment", "inferd-redis")["spec"]["template"]["spec"]
    [redis] = pod["containers"]
    args = redis["args"]
    m = re.fullmatch(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", args[args.index("--requirepass") + 1])
    assert m, args
    source = env_secret(redis, m.group(1))
    assert not source.get("optional")
    assert source == env_secret(redis, "REDISCLI_AUTH")  # what the redis-cli probe authenticates with
    assert redis["readinessProbe"]["exec"]["command"][0] == "redis-cli"
    for name in ("inferd-gateway", "inferd-worker"):
        _, c, ns = parsed[name]
        ref = env_secret(c, "INFERD_REDIS_PASSWORD")
        assert (ref["name"], ref["key"], ref.get("optional")) == (source["name"], source["key"], None), name
        url = ns.redis if name == "inferd-gateway" else ns.register
        assert "@" not in url, f"{name}: a password in its --redis URL would be on its command line"


def test_the_gateways_metrics_need_a_key_from_a_secret(parsed):
    """/metrics names tenants: the gateway requires INFERD_METRICS_KEY, from a Secret (not optional)."""
    _, c, gateway = parsed["inferd-gateway"]
    ref = env_secret(c, "INFERD_METRICS_KEY")
    assert not ref.get("optional")
    assert gateway.metrics_key is None  # never on the command line


def ingress_sources(policy: dict, objects) -> tuple[set[str], set[int]]:
    """The Deployments whose pods a policy's ingress rules let in, and the ports they open."""
    deployments = [o["metadata"]["name"] for _, o in objects if o["kind"] == "Deployment"]
    sources, ports = set(), set()
    for rule in policy["spec"]["ingress"]:
        for peer in rule["from"]:
            assert set(peer) == {"podSelector"}, f"{policy['metadata']['name']}: only pods of ours, got {peer}"
            selector = peer["podSelector"]["matchLabels"].items()
            sources |= {d for d in deployments if selector <= pod_labels(objects, d).items()}
        ports |= {p["port"] for p in rule["ports"]}
    return sources, ports


def policies_of(objects, deployment: str) -> list[dict]:
    labels = pod_labels(objects, deployment).items()
    return [o for _, o in objects if o["kind"] == "NetworkPolicy"
            and o["spec"]["podSelector"]["matchLabels"].items() <= labels]


def test_only_the_gateways_reach_the_workers_and_only_inferd_reaches_redis(parsed, objects):
    from inferd.worker.address import parse_address

    _, _, worker = parsed["inferd-worker"]
    listen_port = parse_address(worker.listen, allow_any_port=True)[1]
    [policy] = policies_of(objects, "inferd-worker")
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    assert ingress_sources(policy, objects) == ({"inferd-gateway"}, {listen_port})
    [policy] = policies_of(objects, "inferd-redis")
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    redis_port = find(objects, "Deployment", "inferd-redis")["spec"]["template"]["spec"]["containers"][0]["ports"][0]
    assert ingress_sources(policy, objects) == ({"inferd-gateway", "inferd-worker"}, {redis_port["containerPort"]})


def test_every_secret_the_manifests_read_is_created_in_the_deployment_guide(objects, repo):
    names = set()
    for _, o in objects:
        if o["kind"] != "Deployment":
            continue
        pod = o["spec"]["template"]["spec"]
        names |= {v["secret"]["secretName"] for v in pod.get("volumes", []) if "secret" in v}
        for c in pod["containers"]:
            names |= {v["valueFrom"]["secretKeyRef"]["name"] for v in c.get("env", [])
                      if "secretKeyRef" in v.get("valueFrom", {})}
    assert {"inferd-redis-password", "inferd-metrics-key", "inferd-worker-secret"} <= names
    guide = (repo / "docs" / "deployment.md").read_text()
    for name in sorted(names):
        assert f"create secret generic {name} " in guide, name
