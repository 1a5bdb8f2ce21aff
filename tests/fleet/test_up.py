"""What `flatfare up` asks of its fleet, and what it says while the first model starts and about payments."""

from __future__ import annotations

from flatfare.cli.up import (FIRST_START, GIVE_UP_AFTER_CRASHES, LOCAL_COLLECTOR, UpOptions, gave_up, payments_line,
                             phase_changes, progress, traces_env, traces_help)
from flatfare.workers.settings import WorkerSettings
from flatfare.contract import FleetStatus

NOW = 1_000_000_000


def test_up_pins_what_the_catalog_pins_with_room_for_every_model_unless_on_demand() -> None:
    models = ["smollm2-135m-instruct", "gemma3-270m"]
    assert UpOptions().fleet_args(models) == ["--model", models[0], "--model", models[1], "--preload", models[0],
                                              "--max-awake", "2"]
    # On demand, the fleet's own default budget (by cores) unless told; the first model still starts at once.
    assert UpOptions(on_demand=True).fleet_args(models) == ["--model", models[0], "--model", models[1],
                                                            "--preload", models[0], "--on-demand"]
    assert UpOptions(on_demand=True, max_awake=1, idle_timeout_s=60).fleet_args(models[:1]) == \
        ["--model", models[0], "--preload", models[0], "--max-awake", "1", "--on-demand", "--idle-timeout", "60"]


def _fleet(**engine: object) -> FleetStatus:
    return FleetStatus("local", "host", engines={"w1": {"model": "m", "state": "starting", **engine}})


def test_progress_says_what_the_engine_does_how_long_it_took_and_should_take() -> None:
    assert progress(None, "m", 0.0, NOW) == "waiting for the fleet to start m"
    assert progress(_fleet(model="other"), "m", 0.0, NOW) == "waiting for the fleet to start m"
    first = progress(_fleet(started_ms=NOW - 42_000, phase="compiling for the CPU"), "m", 0.0, NOW)
    assert first == f"starting m: compiling for the CPU (42 s; {FIRST_START})"
    again = progress(_fleet(started_ms=NOW - 5_000, phase="loading weights"), "m", 51.4, NOW)
    assert again == "starting m: loading weights (5 s; the last start took 51 s)"
    # No phase heartbeated yet: its state.
    assert progress(_fleet(started_ms=NOW), "m", 0.0, NOW).startswith("starting m: starting (0 s;")


def test_up_gives_up_on_a_first_model_that_keeps_failing_and_says_why() -> None:
    def crashed(n: int, model: str = "m") -> FleetStatus:
        return FleetStatus("local", "host", decisions=[
            {"t": i, "action": "crashed", "model": model, "worker_id": f"w{i}", "why": f"error {i}"} for i in range(n)])

    assert gave_up(None, "m") == ""
    assert gave_up(crashed(GIVE_UP_AFTER_CRASHES - 1), "m") == ""
    assert gave_up(crashed(GIVE_UP_AFTER_CRASHES, model="other"), "m") == ""
    assert gave_up(crashed(GIVE_UP_AFTER_CRASHES), "m") == f"error {GIVE_UP_AFTER_CRASHES - 1}"


def test_a_start_after_the_key_shows_one_line_a_phase() -> None:
    phases: dict[str, str] = {}
    assert phase_changes(None, phases) == []
    assert phase_changes(_fleet(phase="preparing the model"), phases) == ["m"]
    assert phase_changes(_fleet(phase="preparing the model"), phases) == []
    assert phase_changes(_fleet(phase="loading weights"), phases) == ["m"]
    assert phase_changes(_fleet(state="warm", phase=""), phases) == []
    # Started again later: its phases are news again.
    assert phase_changes(_fleet(phase="preparing the model"), phases) == ["m"]


def test_plain_up_says_billing_is_off_and_how_to_try_payments() -> None:
    off = payments_line("none", "http://127.0.0.1:8000")
    assert "off" in off and "--payments local" in off
    assert "test card" in payments_line("local", "http://127.0.0.1:8000")
    assert UpOptions().payments == "none"


def test_up_traces_points_every_process_at_a_local_collector_and_says_how_to_run_one(monkeypatch) -> None:
    """`flatfare up --traces` starts nothing: its processes get the collector's endpoint and a ratio of 1
    (unless the person set their own), and it prints how to run a collector there."""
    env = traces_env({"PATH": "/bin"})
    assert (env["FLATFARE_TRACES_ENDPOINT"], env["FLATFARE_TRACES_SAMPLE_RATIO"]) == (LOCAL_COLLECTOR, "1")
    for name, value in env.items():  # what a child process's settings read from it: tracing on
        monkeypatch.setenv(name, value)
    settings = WorkerSettings()
    assert (settings.traces_endpoint, settings.traces_sample_ratio) == (LOCAL_COLLECTOR, 1.0)
    mine = traces_env({"FLATFARE_TRACES_ENDPOINT": "http://collector:4318", "FLATFARE_TRACES_SAMPLE_RATIO": "0.1"})
    assert (mine["FLATFARE_TRACES_ENDPOINT"], mine["FLATFARE_TRACES_SAMPLE_RATIO"]) == ("http://collector:4318", "0.1")
    said = traces_help(env)
    assert LOCAL_COLLECTOR in said and "4318:4318" in said and "docker run" in said
