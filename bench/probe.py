"""Checks run from inside a host of bench.hosts, where its addresses are reachable:

``python -m bench.probe completion URL KEY MODEL`` sends one chat completion and prints
``{"status": ..., "body": ...}``; ``python -m bench.probe redis URL COMMAND...`` runs one Redis command
and prints its raw reply as JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.request
from typing import Any


def completion(url: str, key: str, model: str, timeout_s: float) -> dict[str, Any]:
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}).encode()
    request = urllib.request.Request(f"{url}/v1/chat/completions", data=body, method="POST",
                                     headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return {"status": response.status, "body": response.read().decode()}
    except urllib.error.HTTPError as exc:
        return {"status": exc.code, "body": exc.read().decode()}
    except OSError as exc:
        return {"status": 0, "body": f"{type(exc).__name__}: {exc}"}


def redis_command(url: str, command: list[str]) -> Any:
    import redis

    client = redis.Redis.from_url(url, decode_responses=True, socket_timeout=10, socket_connect_timeout=5)
    client.response_callbacks.clear()  # Redis's own reply, as redis-cli would print it
    try:
        return client.execute_command(*command)
    finally:
        client.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.probe", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="check", required=True)
    one = sub.add_parser("completion")
    one.add_argument("url")
    one.add_argument("key")
    one.add_argument("model")
    one.add_argument("--timeout", type=float, default=10.0)
    command = sub.add_parser("redis")
    command.add_argument("url")
    command.add_argument("command", nargs="+")
    args = parser.parse_args(argv)
    if args.check == "completion":
        result = completion(args.url, args.key, args.model, args.timeout)
    else:
        result = redis_command(args.url, args.command)
    json.dump(result, sys.stdout)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
