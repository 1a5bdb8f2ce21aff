"""``flatfare up``: the whole platform on one machine, on embedded defaults.

A SQLite file and (unless FLATFARE_REDIS_URL is set) a private redis-server, both under the data
folder; migrations; a fleet supervisor (``flatfare fleet``) serving the models on vLLM's CPU backend
(by default both built-in models, prepared from their PyPI wheels once); the gateway on 127.0.0.1.
The first model starts at once and the key is printed when it is warm; the others start at their
first request (the catalog's pinned models stay up unless ``--on-demand``). With ``--payments local``,
a Stripe stand-in too (localstripe and a Checkout page: :mod:`flatfare.cli.local_payments`), so a plan
can be bought in the console; without it billing is off. Ctrl-C stops all of it.
Each child's output goes to ``<data>/logs``; the fleet's workers log to ``worker-<model>-<n>.log``.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import redis as redis_sync
from rich.console import Console

from flatfare import contract
from flatfare.redis_local import LocalRedis
from flatfare.settings import CommonSettings
from flatfare.cli.keys import create_key
from flatfare.cli.local_payments import LocalPayments, LocalPaymentsError, sellable_plans
from flatfare.storage.db import migrate

console = Console(stderr=True)
LOCAL_ACCOUNT = "local"
LOCAL_PLAN = "pro"
READY_TIMEOUT_S = 900
# The fleet `flatfare up` runs, named so its status can be read back.
FLEET_ID = "local"
# The fleet waits this long for its workers to drain (FLATFARE_FLEET_STOP_TIMEOUT_S): give it more.
FLEET_STOP_TIMEOUT_S = 90.0
# The first model's worker failing this many times in a row ends `flatfare up` (its error printed)
# rather than leaving the person waiting for the ready timeout.
GIVE_UP_AFTER_CRASHES = 3
# Said while a model starts for the first time on this machine (no start measured yet).
FIRST_START = "the first start compiles the model for the CPU: 3 to 5 minutes"
# The models `flatfare up` serves unless told otherwise: the built-in ones (workers/prepare.py), the
# embedding model included (its engine starts at its first request, as every model but the first).
UP_MODELS = ("smollm2-135m-instruct", "gemma3-270m", "all-minilm-l6-v2")


def _child_env(settings: CommonSettings, redis_url: str) -> dict[str, str]:
    env = dict(os.environ)
    env["FLATFARE_REDIS_URL"] = redis_url
    env["FLATFARE_DATA_DIR"] = str(settings.data_dir)
    env["FLATFARE_DATABASE_URL"] = settings.resolved_database_url
    # Keep vLLM's CPU KV cache modest on a laptop unless the user sized it: 1 GiB a worker holds
    # ~20k tokens of either built-in model, ten full 2048-token contexts.
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.setdefault("VLLM_NO_USAGE_STATS", "1")
    # vLLM 0.32's CPU build cannot load the AOT-compiled model it saves ("'function' object has no
    # attribute 'finalize_loading'") and compiles again at every start; without AOT a later start reuses
    # the kernels PyTorch cached (/tmp/torchinductor_$USER): ready in 53 s instead of 118 s on 2 cores.
    env.setdefault("VLLM_USE_AOT_COMPILE", "0")
    # The web console is served over plain http on 127.0.0.1: its session cookie cannot be Secure.
    env.setdefault("FLATFARE_LOCAL_MODE", "1")
    return env


# Where `flatfare up --traces` sends spans unless FLATFARE_TRACES_ENDPOINT is set: an OTLP/HTTP collector
# on this machine, e.g. Jaeger's all-in-one image.
LOCAL_COLLECTOR = "http://127.0.0.1:4318"


def traces_env(env: dict[str, str]) -> dict[str, str]:
    """``env`` with every request traced to the local collector, unless the person chose an endpoint or a
    ratio already."""
    return {**env, "FLATFARE_TRACES_ENDPOINT": env.get("FLATFARE_TRACES_ENDPOINT") or LOCAL_COLLECTOR,
            "FLATFARE_TRACES_SAMPLE_RATIO": env.get("FLATFARE_TRACES_SAMPLE_RATIO") or "1"}


def traces_help(env: dict[str, str]) -> str:
    """What `flatfare up --traces` says: where the spans go and how to run a collector that shows them."""
    endpoint = env["FLATFARE_TRACES_ENDPOINT"]
    return (f"Traces: every process sends its spans (ratio {env['FLATFARE_TRACES_SAMPLE_RATIO']}) over OTLP/HTTP to "
            f"{endpoint}. Nothing is started for them; to see them, run a collector there, e.g. Jaeger:\n"
            "  docker run --rm -p 16686:16686 -p 4318:4318 jaegertracing/all-in-one:latest\n"
            "and open http://127.0.0.1:16686 (service flatfare-gateway). Spans sent while none listens are "
            "dropped.")


def _spawn(args: list[str], env: dict[str, str], log_path: Path) -> subprocess.Popen[bytes]:
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log = log_path.open("ab")
    # A new session: Ctrl-C reaches only us, and we stop the children in order.
    return subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def _stop(process: subprocess.Popen[bytes], timeout_s: float = 30.0) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


@dataclass(frozen=True, slots=True)
class UpOptions:
    models: list[str] | None = None
    port: int = 8000
    # "local": a Stripe stand-in on this machine (flatfare/cli/local_payments.py), so plans can be bought
    # in the console with a test card; "none": billing is off, as without Stripe settings.
    payments: str = "none"
    # No model kept up, the catalog's pinned ones included: a small machine runs one engine at a time.
    on_demand: bool = False
    max_awake: int | None = None
    idle_timeout_s: float | None = None
    # The processes' spans to a local OTLP/HTTP collector (traces_env); `up` starts none (traces_help).
    traces: bool = False

    def fleet_args(self, models: list[str]) -> list[str]:
        """`flatfare fleet`'s options: these models, the first started at once. Unless on demand, as
        many engines as models may run, so a pinned model never keeps an on-demand one out."""
        args = [arg for model in models for arg in ("--model", model)] + ["--preload", models[0]]
        max_awake = self.max_awake or (None if self.on_demand else len(models))
        if max_awake:
            args += ["--max-awake", str(max_awake)]
        if self.on_demand:
            args.append("--on-demand")
        if self.idle_timeout_s:
            args += ["--idle-timeout", str(self.idle_timeout_s)]
        return args


def _fleet_status(client: redis_sync.Redis) -> contract.FleetStatus | None:
    try:
        raw = client.get(contract.fleet_key(FLEET_ID))
    except redis_sync.RedisError:
        return None
    return contract.FleetStatus.decode(raw) if raw else None


def _start_time(client: redis_sync.Redis, model: str) -> float:
    """How long the model's last start took (s; 0: never measured here)."""
    try:
        return contract.ModelFacts.from_fields(client.hgetall(contract.model_facts_key(model))).start_s
    except redis_sync.RedisError:
        return 0.0


def progress(fleet: contract.FleetStatus | None, model: str, last_start_s: float, now_ms: int) -> str:
    """What the first model's engine is doing, how long it has been at it, and how long it should take."""
    engines = [e for e in (fleet.engines.values() if fleet else ()) if e["model"] == model]
    if not engines:
        return f"waiting for the fleet to start {model}"
    engine = max(engines, key=lambda e: e.get("started_ms", 0))
    elapsed = max(now_ms - int(engine.get("started_ms") or now_ms), 0) / 1000
    expected = f"the last start took {last_start_s:.0f} s" if last_start_s else FIRST_START
    doing = engine.get("phase") or engine["state"]
    return f"starting {model}: {doing} ({elapsed:.0f} s; {expected})"


def gave_up(fleet: contract.FleetStatus | None, model: str) -> str:
    """Why the model's worker keeps failing, once it failed GIVE_UP_AFTER_CRASHES times ("" before)."""
    crashes = [d for d in (fleet.decisions if fleet else []) if d["action"] == "crashed" and d["model"] == model]
    return crashes[-1]["why"] if len(crashes) >= GIVE_UP_AFTER_CRASHES else ""


def phase_changes(fleet: contract.FleetStatus | None, phases: dict[str, str]) -> list[str]:
    """Models whose starting engine moved to another phase since ``phases`` (updated), so a start after
    the key was printed shows its progress too, one line a phase."""
    now = {e["model"]: e.get("phase") or e["state"] for e in (fleet.engines.values() if fleet else ())
           if e["state"] == "starting"}
    changed = [model for model, phase in sorted(now.items()) if phases.get(model) != phase]
    phases.clear()
    phases.update(now)
    return changed


def _news(fleet: contract.FleetStatus | None, seen_ms: int) -> tuple[list[str], int]:
    """The fleet's decisions since ``seen_ms``, as lines; the newest decision's time."""
    if fleet is None:
        return [], seen_ms
    fresh = [d for d in fleet.decisions if d["t"] > seen_ms]
    return ([f"fleet: {d['action']} {d['model']}: {d['why']}" for d in fresh],
            max((d["t"] for d in fresh), default=seen_ms))


def payments_line(payments: str, base_url: str) -> str:
    """What `flatfare up` says about payments once ready."""
    if payments == "local":
        return (f"Payments: a local Stripe stand-in. Buy a plan at {base_url}/console/billing: its checkout takes a "
                "test card and charges nothing; Stripe's webhook changes the plan as it would in production.")
    return ("Payments: off (billing is not configured: the console says so, plans change through an admin). "
            "`flatfare up --payments local` starts a local Stripe stand-in to try buying a plan.")


def _examples(base_url: str, key: str, models: list[str], payments: str = "none") -> str:
    model = models[0]
    later = ", ".join(models[1:])
    on_demand = (f"\n{later}: started at its first request, which waits for it (`flatfare fleet status` shows "
                 "what the fleet does)\n") if later else ""
    return f"""
[bold green]Flatfare is ready[/] at {base_url}/v1, serving {model}{on_demand}

API key (shown once): [bold]{key}[/]

curl:
  curl {base_url}/v1/chat/completions -H "Authorization: Bearer {key}" -H "Content-Type: application/json" \\
    -d '{{"model": "{model}", "messages": [{{"role": "user", "content": "What is the capital of France?"}}], "temperature": 0}}'

Python (pip install openai):
  python3 -c 'from openai import OpenAI; c = OpenAI(base_url="{base_url}/v1", api_key="{key}"); print(c.chat.completions.create(model="{model}", messages=[{{"role": "user", "content": "What is the capital of France?"}}], temperature=0).choices[0].message.content)'

Models and what each can do: curl {base_url}/v1/models -H "Authorization: Bearer {key}"
Prometheus metrics: {base_url}/metrics
Web console: {base_url}/console (sign up, keys, playground; admins log in with `flatfare admin bootstrap`'s token)
{payments_line(payments, base_url)}

Press Ctrl-C to stop.
"""


def _print_console_emails(log_path: Path, offset: int) -> int:
    """Print the console's emails (reset and confirmation links) the gateway logged for want of an SMTP
    server since ``offset``; the new offset."""
    from flatfare.gateway.console.mail import LOG_MARK

    try:
        with log_path.open("rb") as handle:
            handle.seek(offset)
            new = handle.read()
    except OSError:
        return offset
    for line in new.decode(errors="replace").splitlines():
        if LOG_MARK in line:
            console.print(line, style="bold yellow", soft_wrap=True, highlight=False, markup=False)
    return offset + len(new)



def run_up(options: UpOptions) -> int:
    settings = CommonSettings()
    models = list(dict.fromkeys(options.models or UP_MODELS))
    first = models[0]
    logs = settings.data_dir / "logs"
    started = time.monotonic()
    local_redis: LocalRedis | None = None
    children: list[tuple[str, subprocess.Popen[bytes]]] = []
    stop_requested = False

    def request_stop(*_: object) -> None:
        nonlocal stop_requested
        stop_requested = True

    signal.signal(signal.SIGTERM, request_stop)
    client: redis_sync.Redis | None = None
    payments: LocalPayments | None = None
    try:
        with console.status("starting") as status:
            redis_url = settings.redis_url
            if not redis_url:
                status.update("starting a private Redis")
                local_redis = LocalRedis(settings.data_dir / "redis").start()
                redis_url = local_redis.url
            client = redis_sync.Redis.from_url(redis_url)
            status.update(f"applying migrations to {settings.resolved_database_url}")
            migrate(settings.resolved_database_url)
            from flatfare.workers.main import ModelSpec  # noqa: F401 - fail early if the worker extra is missing
            from flatfare.workers.prepare import BUILTIN_MODELS, resolve_source

            # The first model before its engine starts (the key waits for it); the others' workers
            # prepare theirs at their first start.
            if first in BUILTIN_MODELS:
                status.update(f"preparing {first}")
                resolve_source(f"builtin:{first}", settings.models_dir,
                               lambda msg: status.update(f"preparing {first}: {msg}"))
            env = {**_child_env(settings, redis_url), "FLATFARE_FLEET_ID": FLEET_ID}
            if options.traces:
                env = traces_env(env)
                console.print(traces_help(env), soft_wrap=True, highlight=False)
            base_url = f"http://127.0.0.1:{options.port}"
            if options.payments == "local":
                status.update("starting the local Stripe stand-in")
                try:
                    plans = asyncio.run(sellable_plans(settings.resolved_database_url))
                    payments = LocalPayments(plans).start(logs / "localstripe.log")
                except LocalPaymentsError as exc:
                    console.print(f"[red]{exc}[/]", soft_wrap=True, highlight=False)
                    return 1
                # Checkout sends the buyer back to the public URL: this gateway's.
                env = {**env, **payments.gateway_env(), "FLATFARE_PUBLIC_URL": env.get("FLATFARE_PUBLIC_URL", base_url)}
            flatfare = [sys.executable, "-m", "flatfare"]
            children.append(("fleet", _spawn([*flatfare, "fleet", *options.fleet_args(models)], env,
                                             logs / "fleet.log")))
            children.append(("gateway", _spawn([*flatfare, "gateway", "--port", str(options.port)], env,
                                               logs / "gateway.log")))
            if payments is not None:
                payments.configure(base_url)  # its webhooks, signed, to this gateway
            deadline = time.monotonic() + READY_TIMEOUT_S
            last_start_s = _start_time(client, first)
            while True:
                if stop_requested:
                    return 130
                for name, child in children:
                    if child.poll() is not None:
                        console.print(f"[red]the {name} exited[/]; its log: {logs / (name + '.log')}")
                        return 1
                try:
                    ready = httpx.get(f"{base_url}/healthz", timeout=2).status_code == 200
                except httpx.HTTPError:
                    ready = False
                fleet = _fleet_status(client)
                warm = fleet is not None and any(e["model"] == first and e["state"] == "warm"
                                                 for e in fleet.engines.values())
                if ready and warm:
                    break
                if time.monotonic() > deadline:
                    console.print(f"[red]not ready after {READY_TIMEOUT_S} s[/]; logs in {logs}")
                    return 1
                unserved = [m for m in models if fleet is not None and m not in fleet.models]
                if unserved:
                    console.print(f"[red]not served[/]: {', '.join(unserved)}: not an enabled model of the catalog "
                                  "(`flatfare admin models list` shows it)", soft_wrap=True, highlight=False)
                    return 1
                failing = gave_up(fleet, first)
                if failing:
                    console.print(f"[red]the {first} worker failed to start {GIVE_UP_AFTER_CRASHES} times[/]: "
                                  f"{failing}", soft_wrap=True, highlight=False)
                    return 1
                if fleet is not None and first in fleet.waiting:
                    status.update(f"{first}: {fleet.waiting[first]}")
                else:
                    status.update(progress(fleet, first, last_start_s, int(time.time() * 1000)))
                time.sleep(1)
        key = asyncio.run(create_key(settings.resolved_database_url, LOCAL_ACCOUNT, LOCAL_PLAN, "flatfare up"))
        console.print(f"ready in {time.monotonic() - started:.1f} s")
        # soft_wrap: long lines stay whole so they copy-paste as printed.
        console.print(_examples(base_url, key, models, options.payments), soft_wrap=True, highlight=False)
        gateway_log = logs / "gateway.log"
        mail_offset = gateway_log.stat().st_size if gateway_log.exists() else 0
        seen_ms = int(time.time() * 1000)
        phases: dict[str, str] = {}
        while not stop_requested:
            for name, child in children:
                if child.poll() is not None:
                    console.print(f"[red]the {name} exited[/] (code {child.returncode}); logs in {logs}")
                    return 1
            mail_offset = _print_console_emails(gateway_log, mail_offset)
            # What the fleet does for a request (a model starting, another stopped) is news to whoever
            # waits for the answer.
            fleet = _fleet_status(client)
            lines, seen_ms = _news(fleet, seen_ms)
            for model in phase_changes(fleet, phases):
                lines.append(progress(fleet, model, _start_time(client, model), int(time.time() * 1000)))
            for line in lines:
                console.print(line, soft_wrap=True, highlight=False, markup=False)
            time.sleep(0.5)
        return 0
    except KeyboardInterrupt:
        return 130
    finally:
        with console.status("stopping"):
            for name, child in reversed(children):
                _stop(child, FLEET_STOP_TIMEOUT_S if name == "fleet" else 30.0)
            if payments is not None:
                payments.stop()
            if client is not None:
                client.close()
            if local_redis is not None:
                local_redis.stop()
        console.print("stopped")
