"""deploy/k8s against Kubernetes' schemas (kubernetes-validate, strict: unknown fields fail), and the KEDA
ScaledObjects (a CRD without a schema here) against their structure and the queue contract."""

from __future__ import annotations

import copy
import json
from typing import Any

import kubernetes_validate
import pytest

from flatfare.gateway.metrics import lane_streams
from flatfare.gateway.settings import GatewaySettings
from tests.deploy.files import K8S, REPO, compose, k8s_documents, load_yaml

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


def test_scaled_objects_scale_a_worker_pool_on_its_models_stream() -> None:
    workers = _workers()
    scaled = _documents("ScaledObject")
    assert {s["spec"]["scaleTargetRef"]["name"] for s in scaled} == set(workers)
    redis_service = next(d for d in _documents("Service") if d["metadata"]["name"] == "flatfare-redis")
    for obj in scaled:
        assert obj["apiVersion"] == KEDA_API and obj["metadata"]["namespace"] == "flatfare"
        spec = obj["spec"]
        assert set(spec) <= {"scaleTargetRef", "minReplicaCount", "maxReplicaCount", "pollingInterval",
                             "cooldownPeriod", "idleReplicaCount", "fallback", "advanced", "triggers"}
        assert 0 <= spec["minReplicaCount"] <= spec["maxReplicaCount"]
        behavior = spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
        assert set(behavior) <= {"scaleUp", "scaleDown"}
        (container,) = workers[spec["scaleTargetRef"]["name"]]["spec"]["template"]["spec"]["containers"]
        model = _env(container)["FLATFARE_MODEL"]
        # One trigger per job stream of the model (its lanes): KEDA scales on the busiest.
        streams = {t["metadata"]["stream"] for t in spec["triggers"]}
        assert streams == set(lane_streams(model).values()), "update the ScaledObject's triggers to the lanes"
        for trigger in spec["triggers"]:
            assert trigger["type"] == "redis-streams"
            metadata = trigger["metadata"]
            assert all(isinstance(v, str) for v in metadata.values())  # KEDA's metadata is a map of strings
            assert int(metadata["streamLength"]) > 0
            host, port = metadata["address"].rsplit(":", 1)
            assert host.split(".")[:2] == ["flatfare-redis", "flatfare"]
            assert int(port) == redis_service["spec"]["ports"][0]["port"]


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
