"""docker-compose.yml against the Compose specification's JSON schema, and against the platform: wiring,
scaling, and images built from the wheel."""

from __future__ import annotations

import copy
import json
import re
from importlib import resources
from typing import Any

import jsonschema
import pytest

from tests.deploy.files import COMPOSE_FILE, DEPLOY, REPO, compose, interpolate, load_yaml


@pytest.fixture(scope="module")
def validator() -> jsonschema.protocols.Validator:
    # The Compose specification's schema as check-jsonschema vendors it (Apache-2.0, from compose-spec).
    text = resources.files("check_jsonschema.builtin_schemas.vendor").joinpath("compose-spec.json").read_text()
    schema = json.loads(text)
    return jsonschema.validators.validator_for(schema)(schema)


@pytest.fixture(scope="module")
def spec() -> dict[str, Any]:
    return compose()


def _errors(validator: jsonschema.protocols.Validator, document: dict[str, Any]) -> list[str]:
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(document)]


def test_compose_file_matches_the_compose_specification(validator) -> None:
    assert _errors(validator, load_yaml(COMPOSE_FILE)) == []


def test_every_variable_has_a_default_so_no_env_file_is_needed(validator, spec) -> None:
    assert _errors(validator, spec) == []  # compose() raises KeyError for a variable without a default
    overridden = compose({"FLATFARE_GPU_IDS": "2,3", "FLATFARE_TENSOR_PARALLEL_SIZE": "2", "FLATFARE_MODEL": "big"})
    worker = overridden["services"]["worker"]
    assert worker["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"] == ["2,3"]
    assert json.loads(worker["environment"]["FLATFARE_ENGINE_OPTIONS"]) == {"tensor_parallel_size": 2}
    assert worker["environment"]["FLATFARE_MODEL"] == "big"


def test_the_schema_catches_mistakes(validator, spec) -> None:
    broken = copy.deepcopy(spec)
    broken["services"]["gateway"]["depends_on"]["redis"]["condition"] = "service_started_eventually"
    broken["services"]["redis"]["restart_policy"] = "always"
    errors = _errors(validator, broken)
    assert any("'restart_policy' was unexpected" in e for e in errors)
    assert any(e.startswith("services/gateway/depends_on:") for e in errors)


def test_services_and_their_wiring(spec) -> None:
    services = spec["services"]
    assert {"redis", "postgres", "migrate", "gateway", "proxy", "worker", "worker-cpu", "prometheus",
            "grafana"} <= set(services)
    redis_command = services["redis"]["command"]
    assert redis_command[redis_command.index("--appendonly") + 1] == "yes"
    assert services["migrate"]["command"] == ["migrate"] and services["migrate"]["restart"] == "no"
    for name in ("gateway", "worker", "worker-cpu"):
        assert services[name]["depends_on"]["migrate"]["condition"] == "service_completed_successfully"
    # Several gateway replicas, none publishing a port: the proxy publishes one for all of them.
    gateway = services["gateway"]
    assert int(gateway["deploy"]["replicas"]) >= 2 and "ports" not in gateway
    assert services["proxy"]["ports"] == ["8000:8000"]
    assert "gateway:8000" in (DEPLOY / "nginx" / "flatfare.conf").read_text()


def test_gpu_worker_reserves_nvidia_devices_and_the_cpu_profile_runs_without(spec) -> None:
    services = spec["services"]
    for name in ("worker", "worker-second-model"):
        device = services[name]["deploy"]["resources"]["reservations"]["devices"][0]
        assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"] and device["device_ids"]
    cpu = services["worker-cpu"]
    assert cpu["profiles"] == ["cpu"] and "deploy" not in cpu
    assert cpu["environment"]["FLATFARE_MODEL"] == "smollm2-135m-instruct"
    # No profile runs a GPU worker unasked: a laptop's `--profile cpu up` must not need the NVIDIA runtime.
    assert all("gpu" in (s.get("profiles") or ["?"]) or "second-model" in s.get("profiles", [])
               for s in services.values() if "deploy" in s and "resources" in s["deploy"])


def test_workers_stop_after_their_drain(spec) -> None:
    for name in ("worker", "worker-second-model", "worker-cpu"):
        service = spec["services"][name]
        grace = int(re.fullmatch(r"(\d+)s", service["stop_grace_period"])[1])
        assert grace > float(service["environment"]["FLATFARE_DRAIN_TIMEOUT_S"])


def test_files_the_compose_file_names_exist(spec) -> None:
    for service in spec["services"].values():
        build = service.get("build")
        if build:
            assert (REPO / build["context"] / build["dockerfile"]).is_file()
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("./"):
                assert (REPO / source).exists(), source


def test_prometheus_scrapes_every_worker_service_on_the_metrics_port(spec) -> None:
    config = load_yaml(DEPLOY / "prometheus" / "prometheus.yml")
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    sd = jobs["flatfare-worker"]["dns_sd_configs"][0]
    workers = {name for name, s in spec["services"].items() if s.get("image", "").startswith("flatfare-worker")}
    assert set(sd["names"]) == workers
    for dockerfile in ("worker.Dockerfile", "worker-cpu.Dockerfile"):
        assert f"FLATFARE_METRICS_PORT={sd['port']}" in (DEPLOY / "docker" / dockerfile).read_text()
    assert jobs["flatfare-gateway"]["dns_sd_configs"][0]["names"] == ["gateway"]


def test_interpolation_follows_compose_rules() -> None:
    env = {"SET": "x", "EMPTY": ""}
    assert interpolate("${SET:-d} ${EMPTY:-d} ${EMPTY-d} ${UNSET-d} $${SET}", env) == "x d  d ${SET}"
    with pytest.raises(KeyError):
        interpolate("${UNSET}", env)


# Services run as several replicas: `deploy.replicas`, or `--scale` (README: `--scale worker-cpu=3`).
SCALED = {"gateway", "worker", "worker-second-model", "worker-cpu"}


def test_scaled_services_can_run_side_by_side(spec) -> None:
    services = spec["services"]
    assert SCALED <= set(services)
    # Compose refuses to scale a service with a fixed container name; none needs one.
    assert [name for name, s in services.items() if "container_name" in s] == []
    for name in SCALED:
        service = services[name]
        # A published host port can be bound by one replica only: replicas are reached on the network
        # (the proxy, Prometheus' DNS discovery), never through the host.
        assert "ports" not in service, name
        # Workers name themselves after their host: each replica must keep the hostname Docker gives it.
        assert "hostname" not in service and "FLATFARE_WORKER_ID" not in service.get("environment", {}), name
        # Replicas share their volumes: the models volume (read by all) and read-only files only.
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            assert source in spec["volumes"] or volume.endswith(":ro"), f"{name}: {volume}"
    published = [str(port).split(":")[0] for s in services.values() for port in s.get("ports", [])]
    assert len(published) == len(set(published)), published


def test_scaled_services_use_images_built_from_the_wheel(spec) -> None:
    for name in [*SCALED, "migrate"]:
        build = spec["services"][name]["build"]
        assert build["context"] == "."
        text = (REPO / build["dockerfile"]).read_text()
        assert "AS wheel" in text and "/wheels/flatfare-" in text, f"{name}'s image does not install the wheel"


def test_the_gateway_service_keeps_the_images_unprivileged_user_and_writes_under_tmp(spec) -> None:
    """docs/OPERATIONS.md: the gateway image runs unprivileged and writes only in /tmp
    (tests/deploy/test_images.py). Compose must not undo either: no root user, no data, metrics or
    temporary folder moved out of /tmp; and its root is read-only with /tmp writable, as in Kubernetes."""
    gateway = spec["services"]["gateway"]
    assert str(gateway.get("user", "flatfare")).split(":")[0] not in ("root", "0")
    environment = gateway.get("environment", {})
    if isinstance(environment, list):
        environment = dict(item.partition("=")[::2] for item in environment)
    for name in ("FLATFARE_DATA_DIR", "FLATFARE_METRICS_DIR", "TMPDIR"):
        value = environment.get(name)
        assert value is None or str(value).startswith("/tmp/"), f"the gateway writes {name}={value}"
    assert gateway.get("read_only") is True
    if gateway.get("read_only"):
        tmpfs = gateway.get("tmpfs", [])
        assert "/tmp" in ([tmpfs] if isinstance(tmpfs, str) else tmpfs) or any(
            v.get("type") == "tmpfs" and v.get("target") == "/tmp" for v in gateway.get("volumes", [])
            if isinstance(v, dict))
