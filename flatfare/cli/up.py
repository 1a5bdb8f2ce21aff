"""``flatfare up``: the whole platform on one machine, on embedded defaults.

A SQLite file and (unless FLATFARE_REDIS_URL is set) a private redis-server, both under the data
folder; migrations; one worker on vLLM's CPU backend for each model (by default both built-in models,
prepared from their PyPI wheels once); the gateway on 127.0.0.1. Ctrl-C stops all of it. Each
child's output goes to ``<data>/logs``.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import redis as redis_sync
from rich.console import Console

from flatfare import contract
from flatfare.redis_local import LocalRedis
from flatfare.settings import CommonSettings
from flatfare.storage.accounts import create_key
from flatfare.storage.db import migrate

console = Console(stderr=True)
LOCAL_ACCOUNT = "local"
LOCAL_PLAN = "pro"
READY_TIMEOUT_S = 900
# The models `flatfare up` serves unless told otherwise: the built-in ones (workers/prepare.py).
UP_MODELS = ("smollm2-135m-instruct", "gemma3-270m")


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


def _spawn(args: list[str], env: dict[str, str], log_path: Path) -> subprocess.Popen[bytes]:
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log = log_path.open("ab")
    # A new session: Ctrl-C reaches only us, and we stop the children in order.
    return subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def _last_line(path: Path) -> str:
    try:
        with path.open("rb") as handle:
            handle.seek(max(path.stat().st_size - 4096, 0))
            lines = [ln for ln in handle.read().decode(errors="replace").splitlines() if ln.strip()]
        return lines[-1][-110:] if lines else ""
    except OSError:
        return ""


def _stop(processes: list[subprocess.Popen[bytes]], timeout_s: float = 30.0) -> None:
    for process in processes:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for process in processes:
        try:
            process.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def _warm(redis_url: str, model: str) -> bool:
    """Whether a worker of ``model`` heartbeats as warm (/readyz waits only for pinned models)."""
    client = redis_sync.Redis.from_url(redis_url)
    try:
        fresh = int(time.time() * 1000 - contract.WORKER_TTL_S * 1000)
        for worker_id in client.zrangebyscore(contract.pool_key(model), fresh, "+inf"):
            fields = client.hgetall(contract.worker_key(worker_id.decode()))
            if fields and contract.WorkerInfo.from_fields(fields).state is contract.WorkerState.WARM:
                return True
        return False
    except redis_sync.RedisError:
        return False
    finally:
        client.close()


def _examples(base_url: str, key: str, models: list[str]) -> str:
    model = models[0]
    served = ", ".join(models)
    return f"""
[bold green]Flatfare is ready[/] at {base_url}/v1, serving {served}

API key (shown once): [bold]{key}[/]

curl:
  curl {base_url}/v1/chat/completions -H "Authorization: Bearer {key}" -H "Content-Type: application/json" \\
    -d '{{"model": "{model}", "messages": [{{"role": "user", "content": "What is the capital of France?"}}], "temperature": 0}}'

Python (pip install openai):
  python3 -c 'from openai import OpenAI; c = OpenAI(base_url="{base_url}/v1", api_key="{key}"); print(c.chat.completions.create(model="{model}", messages=[{{"role": "user", "content": "What is the capital of France?"}}], temperature=0).choices[0].message.content)'

Models and what each can do: curl {base_url}/v1/models -H "Authorization: Bearer {key}"
Prometheus metrics: {base_url}/metrics
Web console: {base_url}/console (sign up, keys, playground; admins log in with `flatfare admin bootstrap`'s token)

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


def run_up(models: list[str] | None, port: int) -> int:
    settings = CommonSettings()
    models = list(dict.fromkeys(models or UP_MODELS))
    logs = settings.data_dir / "logs"
    started = time.monotonic()
    local_redis: LocalRedis | None = None
    children: list[tuple[str, subprocess.Popen[bytes]]] = []
    stop_requested = False

    def request_stop(*_: object) -> None:
        nonlocal stop_requested
        stop_requested = True

    signal.signal(signal.SIGTERM, request_stop)
    try:
        with console.status("starting") as status:
            redis_url = settings.redis_url
            if not redis_url:
                status.update("starting a private Redis")
                local_redis = LocalRedis(settings.data_dir / "redis").start()
                redis_url = local_redis.url
            status.update(f"applying migrations to {settings.resolved_database_url}")
            migrate(settings.resolved_database_url)
            from flatfare.workers.main import ModelSpec  # noqa: F401 - fail early if the worker extra is missing
            from flatfare.workers.prepare import BUILTIN_MODELS, resolve_source

            # One at a time, before any engine starts: preparing is CPU-bound, and so is an engine.
            for model in models:
                if model in BUILTIN_MODELS:
                    status.update(f"preparing {model}")
                    resolve_source(f"builtin:{model}", settings.models_dir,
                                   lambda msg, model=model: status.update(f"preparing {model}: {msg}"))
            env = _child_env(settings, redis_url)
            flatfare = [sys.executable, "-m", "flatfare"]
            for model in models:
                children.append((f"worker-{model}", _spawn([*flatfare, "worker", "--model", model], env,
                                                           logs / f"worker-{model}.log")))
            children.append(("gateway", _spawn([*flatfare, "gateway", "--port", str(port)], env, logs / "gateway.log")))
            base_url = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + READY_TIMEOUT_S
            while True:
                if stop_requested:
                    return 130
                for name, child in children:
                    if child.poll() is not None:
                        console.print(f"[red]the {name} exited[/]; its log: {logs / (name + '.log')}")
                        return 1
                try:
                    ready = httpx.get(f"{base_url}/readyz", timeout=2).status_code == 200
                except httpx.HTTPError:
                    ready = False
                waiting = [model for model in models if not _warm(redis_url, model)]
                if ready and not waiting:
                    break
                if time.monotonic() > deadline:
                    console.print(f"[red]not ready after {READY_TIMEOUT_S} s[/]; logs in {logs}")
                    return 1
                elapsed = time.monotonic() - started
                shown = waiting[0] if waiting else models[0]
                status.update(f"waiting for the engines ({elapsed:.0f} s; warm: "
                              f"{len(models) - len(waiting)}/{len(models)}): "
                              f"{_last_line(logs / f'worker-{shown}.log')}")
                time.sleep(1)
        key = asyncio.run(create_key(settings.resolved_database_url, LOCAL_ACCOUNT, LOCAL_PLAN, "flatfare up"))
        console.print(f"ready in {time.monotonic() - started:.1f} s")
        # soft_wrap: long lines stay whole so they copy-paste as printed.
        console.print(_examples(base_url, key, models), soft_wrap=True, highlight=False)
        gateway_log = logs / "gateway.log"
        mail_offset = gateway_log.stat().st_size if gateway_log.exists() else 0
        while not stop_requested:
            for name, child in children:
                if child.poll() is not None:
                    console.print(f"[red]the {name} exited[/] (code {child.returncode}); logs in {logs}")
                    return 1
            mail_offset = _print_console_emails(gateway_log, mail_offset)
            time.sleep(0.5)
        return 0
    except KeyboardInterrupt:
        return 130
    finally:
        with console.status("stopping"):
            _stop([child for _, child in reversed(children)])
            if local_redis is not None:
                local_redis.stop()
        console.print("stopped")
