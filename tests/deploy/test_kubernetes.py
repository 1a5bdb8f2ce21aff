"""deploy/k8s against Kubernetes' schemas (kubernetes-validate, strict: unknown fields fail), and the KEDA
ScaledObjects (a CRD without a schema here) against their structure, the metrics the gateway exports
and, with promtool, what their queries compute."""

from __future__ import annotations

import copy
import json
import math
import re
import subprocess
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import kubernetes_validate
import pytest
import yaml
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from flatfare.gateway.metrics import MULTIPROC_ENV, GatewayMetrics, exposition
from flatfare.gateway.platform_metrics import PlatformSnapshot
from flatfare.gateway.settings import GatewaySettings
from tests.conftest import need
from tests.deploy.files import K8S, REPO, compose, grouping_labels, k8s_documents, load_yaml
from tests.deploy.test_observability import PROMTOOL, PROMTOOL_MISSING

KUBERNETES_VERSION = "1.30.0"  # the oldest release still in common support; newer ones accept these too
KEDA_API = "keda.sh/v1alpha1"


def _documents(kind: str | None = None) -> list[dict[str, Any]]:
    return [doc for _, doc in k8s_documents() if kind is None or doc["kind"] == kind]


def _env(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}


@pytest.mark.parametrize(("path", "doc"), [pytest.param(p, d, id=f"{p.name}:{d['kind']}:{d['metadata']['name']}")
                                           for p, d in k8s_documents() if d["apiVersion"] != KEDA_API])
def test_manifest_matches_the_kubernetes_schema(path, doc) -> None:
    kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_the_schemas_catch_mistakes() -> None:
    (deployment, *_) = _documents("Deployment")
    broken = copy.deepcopy(deployment)
    broken["spec"]["template"]["spec"]["containers"][0]["resource"] = {"limits": {"nvidia.com/gpu": 1}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES_VERSION, strict=True)


def test_kustomization_lists_existing_files_and_every_long_lived_manifest() -> None:
    listed = load_yaml(K8S / "kustomization.yaml")["resources"]
    assert all((K8S / name).is_file() for name in listed)
    # The migration Job is applied on its own, once per release.
    assert set(listed) | {"migrate-job.yaml"} == {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}


def _workers() -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in _documents("Deployment")
            if d["metadata"]["labels"].get("app.kubernetes.io/component") == "worker"}


def test_worker_deployments_request_gpus_and_outlast_their_drain() -> None:
    workers = _workers()
    assert workers
    for deployment in workers.values():
        pod = deployment["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        env = _env(container)
        assert env["FLATFARE_MODEL"]
        gpus = int(container["resources"]["limits"]["nvidia.com/gpu"])
        assert gpus == json.loads(env["FLATFARE_ENGINE_OPTIONS"]).get("tensor_parallel_size", 1)
        pre_stop = 0  # workers pull from Redis, so no preStop pause is needed before SIGTERM
        assert pod["terminationGracePeriodSeconds"] > pre_stop + float(env["FLATFARE_DRAIN_TIMEOUT_S"])
        assert container["ports"][0]["containerPort"] == int(env["FLATFARE_METRICS_PORT"])
        assert deployment["spec"]["template"]["metadata"]["annotations"]["prometheus.io/port"] == env[
            "FLATFARE_METRICS_PORT"]


def test_gateway_grace_covers_its_pre_stop_pause_and_the_request_timeout() -> None:
    (gateway,) = [d for d in _documents("Deployment") if d["metadata"]["name"] == "flatfare-gateway"]
    pod = gateway["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    pause = int(container["lifecycle"]["preStop"]["exec"]["command"][-1])
    assert pod["terminationGracePeriodSeconds"] >= pause + GatewaySettings.model_fields["request_timeout_s"].default
    assert container["readinessProbe"]["httpGet"]["path"] == "/healthz"


def test_disruption_budgets_select_pods_of_a_deployment() -> None:
    pod_labels = [d["spec"]["template"]["metadata"]["labels"] for d in _documents("Deployment")]
    for budget in _documents("PodDisruptionBudget"):
        selector = budget["spec"]["selector"]["matchLabels"]
        assert any(selector.items() <= labels.items() for labels in pod_labels), budget["metadata"]["name"]


# What a worker pool scales on: the requests that need a worker of its model (waiting in a lane or a
# worker's own stream, or taken and not finished), as the gateway's /metrics reports it.
QUEUE_METRICS = {"flatfare_model_demand"}
# A metric selector with its label matchers: flatfare_queue_depth{model="m", lane=~"p.*"}.
_SELECTOR = re.compile(r"(?P<name>flatfare_[A-Za-z0-9_:]*)\s*(?:\{(?P<matchers>[^}]*)\})?")
_MATCHER = re.compile(r'(?P<label>[A-Za-z_][A-Za-z0-9_]*)\s*(?P<op>=~|!~|!=|=)\s*"(?P<value>[^"]*)"')


def _selectors(query: str) -> list[tuple[str, dict[str, str]]]:
    """``(metric name, {label: value})`` for every Flatfare metric in ``query``; equality matchers only,
    so that what a selector picks can be checked against the gateway's samples."""
    found = []
    for selector in _SELECTOR.finditer(query):
        matchers = list(_MATCHER.finditer(selector["matchers"] or ""))
        assert all(m["op"] == "=" for m in matchers), f"only label=\"value\" matchers: {selector[0]!r}"
        found.append((selector["name"], {m["label"]: m["value"] for m in matchers}))
    return found


def _pools() -> list[tuple[dict[str, Any], str]]:
    """Every ScaledObject with the FLATFARE_MODEL of the worker Deployment it scales."""
    workers = _workers()
    pools = []
    for obj in _documents("ScaledObject"):
        (container,) = workers[obj["spec"]["scaleTargetRef"]["name"]]["spec"]["template"]["spec"]["containers"]
        pools.append((obj, _env(container)["FLATFARE_MODEL"]))
    return pools


def _queue_triggers() -> list[tuple[str, dict[str, Any]]]:
    return [(model, trigger) for obj, model in _pools() for trigger in obj["spec"]["triggers"]]


def test_scaled_objects_scale_a_worker_pool_on_its_models_queue() -> None:
    workers = _workers()
    scaled = _documents("ScaledObject")
    assert {s["spec"]["scaleTargetRef"]["name"] for s in scaled} == set(workers)
    for obj, model in _pools():
        assert obj["apiVersion"] == KEDA_API and obj["metadata"]["namespace"] == "flatfare"
        spec = obj["spec"]
        assert set(spec) <= {"scaleTargetRef", "minReplicaCount", "maxReplicaCount", "pollingInterval",
                             "cooldownPeriod", "idleReplicaCount", "fallback", "advanced", "triggers"}
        assert 0 <= spec["minReplicaCount"] <= spec["maxReplicaCount"]
        behavior = spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
        assert set(behavior) <= {"scaleUp", "scaleDown"}
        # Several triggers would scale on the busiest one alone unless a scaling modifier adds them up.
        assert len(spec["triggers"]) == 1 or "scalingModifiers" in spec["advanced"]
        for trigger in spec["triggers"]:
            # Waiting jobs sit in per-account queues, not in the lane's stream: only the gateway's
            # metrics see them, so a redis-streams trigger would miss the backlog.
            assert trigger["type"] == "prometheus"
            metadata = trigger["metadata"]
            assert all(isinstance(v, str) for v in metadata.values())  # KEDA's metadata is a map of strings
            assert float(metadata["threshold"]) > 0
            # KEDA activates a pool (0 -> 1) when the value is above this: one request must be enough.
            assert 0 <= float(metadata["activationThreshold"]) < 1
            assert metadata.get("ignoreNullValues") == "false", "an empty answer is a lost target, not no work"
            used = _selectors(metadata["query"])
            assert {name for name, _ in used} == QUEUE_METRICS, metadata["query"]
            for name, labels in used:
                assert labels.get("model") == model, f"{name} in {obj['metadata']['name']} must select {model}"


def _gateway_samples(monkeypatch: pytest.MonkeyPatch, models: list[str]) -> list[tuple[str, dict[str, str]]]:
    """The samples of the gateway's /metrics exposition (one process) with demand for every one of ``models``."""
    monkeypatch.delenv(MULTIPROC_ENV, raising=False)
    snapshot = PlatformSnapshot(demand={m: 3 for m in models})
    text = exposition(GatewayMetrics(CollectorRegistry()), snapshot).decode()
    return [(s.name, s.labels) for family in text_string_to_metric_families(text) for s in family.samples]


def test_queue_queries_select_what_the_gateway_exports(monkeypatch: pytest.MonkeyPatch) -> None:
    triggers = _queue_triggers()
    assert triggers
    samples = _gateway_samples(monkeypatch, sorted({model for model, _ in triggers}))
    for model, trigger in triggers:
        query = trigger["metadata"]["query"]
        for name, matchers in _selectors(query):
            picked = [labels for sample, labels in samples if sample == name and matchers.items() <= labels.items()]
            assert picked == [{"model": model}], f"{name}{matchers} is not in the gateway's /metrics (metrics.py)"
            assert grouping_labels(query) <= set(picked[0]), f"grouping by a label {name} lacks in {query!r}"


def test_pools_kept_on_demand_scale_from_zero_through_the_gateways() -> None:
    """A pool may scale to zero only if the gateways queue requests for a model with no worker
    (FLATFARE_EXTERNAL_SCALER in the ConfigMap every pod reads); otherwise its first request would be
    refused, and nothing would ever ask for a worker."""
    on_demand = [model for obj, model in _pools() if obj["spec"]["minReplicaCount"] == 0]
    assert on_demand, "no pool shows scaling from zero"
    (config,) = [d for d in _documents("ConfigMap") if d["metadata"]["name"] == "flatfare-config"]
    assert GatewaySettings(external_scaler=config["data"]["FLATFARE_EXTERNAL_SCALER"]).external_scaler is True


def test_promtool_computes_the_workers_a_demand_asks_for(tmp_path: Path) -> None:
    """Two gateway replicas report the same demand (every replica reads it from Redis): the query counts
    it once and ignores other models."""
    need(PROMTOOL, PROMTOOL_MISSING)
    demand = 100  # 2 workers at a threshold of 64
    for model, trigger in _queue_triggers():
        series = [{"series": f'flatfare_model_demand{{instance="{instance}",job="flatfare-gateway",model="{name}"}}',
                   "values": f"{count}x10"}
                  for instance in ("gateway-a:8000", "gateway-b:8000")
                  for name, count in ((model, demand), ("another-model", 1000))]
        unit_tests = {"rule_files": [], "evaluation_interval": "1m", "tests": [{
            "interval": "1m", "input_series": series,
            "promql_expr_test": [{"expr": trigger["metadata"]["query"], "eval_time": "5m",
                                  "exp_samples": [{"labels": "{}", "value": demand}]}]}]}
        path = tmp_path / f"{model}.test.yml"
        path.write_text(yaml.safe_dump(unit_tests, sort_keys=False))
        result = subprocess.run([PROMTOOL, "test", "rules", str(path)], capture_output=True, text=True, timeout=60,
                                check=False)
        assert result.returncode == 0, result.stdout + result.stderr
        assert math.ceil(demand / float(trigger["metadata"]["threshold"])) == 2


def _field(doc: Any, path: str) -> list[Any]:
    """The values at a kustomize field path (``spec.triggers.*.metadata.serverAddress``); none where the
    path does not lead (kustomize then fails the build)."""
    found = [doc]
    for part in path.split("."):
        step = []
        for value in found:
            if part == "*" and isinstance(value, list):
                step.extend(value)
            elif isinstance(value, dict) and part in value:
                step.append(value[part])
        found = step
    return found


def test_kustomize_gives_every_scaled_object_the_prometheus_address() -> None:
    """The address is one setting (config.yaml's flatfare-autoscaling), which kustomization.yaml's
    replacements copy into every prometheus trigger; the manifests carry the same value for a plain
    ``kubectl apply -f``."""
    (replacement,) = [r for r in load_yaml(K8S / "kustomization.yaml")["replacements"]
                      if r["source"]["name"] == "flatfare-autoscaling"]
    source = replacement["source"]
    (config,) = [d for d in _documents(source["kind"]) if d["metadata"]["name"] == source["name"]]
    # Local config: kustomize reads it and leaves it out of what it applies.
    assert config["metadata"]["annotations"]["config.kubernetes.io/local-config"] == "true"
    (address,) = _field(config, source["fieldPath"])
    assert urlsplit(address).scheme in {"http", "https"} and urlsplit(address).hostname, address
    for obj, _ in _pools():
        reached = [value for target in replacement["targets"]
                   if target["select"].get("kind") == obj["kind"]
                   and target["select"].get("name", obj["metadata"]["name"]) == obj["metadata"]["name"]
                   for path in target["fieldPaths"] for value in _field(obj, path)]
        triggers = [t for t in obj["spec"]["triggers"] if t["type"] == "prometheus"]
        assert len(reached) == len(triggers), f"the replacement misses a trigger of {obj['metadata']['name']}"
        assert reached == [address] * len(triggers), "keep the manifest's serverAddress equal to config.yaml's"


def _containers(doc: dict[str, Any]) -> list[dict[str, Any]]:
    pod = doc.get("spec", {}).get("template", {}).get("spec", {})
    return [*pod.get("initContainers", []), *pod.get("containers", [])]


def test_pods_run_the_images_compose_builds_from_the_wheel() -> None:
    # The images `docker compose build` tags (FLATFARE_VERSION unset: latest), each from a Dockerfile whose
    # first stage builds the wheel that the image installs (tests/deploy/test_images.py).
    built = {s["image"]: s["build"]["dockerfile"] for s in compose()["services"].values() if "build" in s}
    for dockerfile in built.values():
        assert "/wheels/flatfare-" in (REPO / dockerfile).read_text()
    used = {c["image"] for _, doc in k8s_documents() for c in _containers(doc) if c["image"].startswith("flatfare")}
    assert used and used <= set(built), f"images that compose does not build: {used - set(built)}"
    # Kustomize rewrites exactly those images (a registry and tag per release).
    rewritten = {(i["name"], f"{i['newName']}:{i['newTag']}") for i in load_yaml(K8S / "kustomization.yaml")["images"]}
    assert {image.split(":")[0] for image in used} == {name for name, _ in rewritten}
    assert {new for _, new in rewritten} <= set(built)
    # The migration Job runs `flatfare migrate` from the gateway image: the wheel carries the migrations.
    (job,) = _documents("Job")
    (container,) = _containers(job)
    assert container["image"].startswith("flatfare-gateway:") and container["args"] == ["migrate"]


def test_the_gateway_pod_runs_unprivileged_on_a_read_only_root() -> None:
    """docs/OPERATIONS.md: the gateway runs as an unprivileged user and writes only in /tmp, so its
    root filesystem may be read-only. The pod makes it so: non-root (the image's own user), a
    read-only root, and every path the gateway writes on an emptyDir volume."""
    from tests.deploy.test_images import GATEWAY_DOCKERFILE, _stages, image_env, image_user

    (deployment,) = [d for d in _documents("Deployment") if d["metadata"]["name"] == "flatfare-gateway"]
    pod = deployment["spec"]["template"]["spec"]
    (container,) = [c for c in pod["containers"] if c["name"] == "gateway"]
    security = {**pod.get("securityContext", {}), **container.get("securityContext", {})}
    _, uid = image_user(GATEWAY_DOCKERFILE)
    assert security.get("runAsNonRoot") is True and security.get("runAsUser") == uid
    assert security.get("readOnlyRootFilesystem") is True
    assert security.get("allowPrivilegeEscalation") is False and "ALL" in security["capabilities"]["drop"]
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    mounts = container.get("volumeMounts", [])
    writable = [m["mountPath"] for m in mounts if "emptyDir" in volumes[m["name"]]]
    # Whatever else is mounted is read-only (a ConfigMap, a Secret).
    assert all(m.get("readOnly") or m["mountPath"] in writable for m in mounts)
    env = image_env(_stages(GATEWAY_DOCKERFILE)[1])
    for source in container.get("envFrom", []):
        if "configMapRef" in source:
            (config,) = [d for d in _documents("ConfigMap") if d["metadata"]["name"] == source["configMapRef"]["name"]]
            env.update(config.get("data", {}))
    env.update(_env(container))
    for path in (env["FLATFARE_DATA_DIR"], env["FLATFARE_METRICS_DIR"], env.get("TMPDIR", "/tmp")):
        assert any(path == w or path.startswith(w.rstrip("/") + "/") for w in writable), \
            f"the gateway writes {path}, on the read-only root"
