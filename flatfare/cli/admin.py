"""``flatfare admin ...``: everyday admin actions, through the admin API (bootstrap aside)."""

from __future__ import annotations

import asyncio
import json
from typing import Annotated, Any

import httpx
import typer

from flatfare.settings import CommonSettings

app = typer.Typer(help="Manage plans, models, accounts, keys; read usage and the audit log.", no_args_is_help=True)
plans_app = typer.Typer(help="Plans.", no_args_is_help=True)
models_app = typer.Typer(help="The model catalog.", no_args_is_help=True)
accounts_app = typer.Typer(help="Accounts.", no_args_is_help=True)
keys_app = typer.Typer(help="API keys.", no_args_is_help=True)
tokens_app = typer.Typer(help="Admin tokens.", no_args_is_help=True)
for sub, name in ((plans_app, "plans"), (models_app, "models"), (accounts_app, "accounts"), (keys_app, "keys"),
                  (tokens_app, "tokens")):
    app.add_typer(sub, name=name)


class AdminCliSettings(CommonSettings):
    admin_url: str = "http://127.0.0.1:8000"
    admin_token: str = ""


SetOption = Annotated[list[str] | None, typer.Option("--set", help="FIELD=VALUE (VALUE as JSON when it parses).")]


def _fields(pairs: list[str] | None) -> dict[str, Any]:
    fields: dict[str, Any] = {}
    for pair in pairs or []:
        name, sep, raw = pair.partition("=")
        if not sep:
            raise typer.BadParameter(f"--set takes FIELD=VALUE, not {pair!r}")
        try:
            fields[name] = json.loads(raw)
        except json.JSONDecodeError:
            fields[name] = raw
    return fields


def _call(method: str, path: str, body: dict[str, Any] | None = None, params: dict[str, Any] | None = None,
          raw: bool = False) -> Any:
    settings = AdminCliSettings()
    if not settings.admin_token:
        typer.secho("error: set FLATFARE_ADMIN_TOKEN (see `flatfare admin bootstrap`)", fg="red", err=True)
        raise typer.Exit(2)
    response = httpx.request(method, f"{settings.admin_url.rstrip('/')}/admin/v1{path}", json=body,
                             params={k: v for k, v in (params or {}).items() if v is not None},
                             headers={"Authorization": f"Bearer {settings.admin_token}"}, timeout=30)
    if response.status_code >= 400:
        error = response.json().get("error", {}) if "json" in response.headers.get("content-type", "") else {}
        typer.secho(f"error {response.status_code}: {error.get('message', response.text)}", fg="red", err=True)
        raise typer.Exit(1)
    if raw:
        typer.echo(response.text, nl=False)
        return None
    data = response.json() if response.content else None
    if data is not None:
        typer.echo(json.dumps(data, indent=2))
    return data


@app.command()
def bootstrap(name: Annotated[str, typer.Option(help="A label for the token.")] = "bootstrap",
              force: Annotated[bool, typer.Option(help="Create one even if admin tokens exist.")] = False) -> None:
    """Create the first admin token (both scopes) directly in the database and print it."""
    from sqlalchemy import func, select

    from flatfare.storage.accounts import issue_admin_token
    from flatfare.storage.db import one_session
    from flatfare.storage.models import AdminToken

    async def run() -> str | None:
        async with one_session(CommonSettings().resolved_database_url) as session, session.begin():
            if not force and await session.scalar(select(func.count()).select_from(AdminToken)):
                return None
            _, secret = await issue_admin_token(session, name, ["admin:read", "admin:write"])
            return secret

    secret = asyncio.run(run())
    if secret is None:
        typer.secho("error: admin tokens exist already; create more with `flatfare admin tokens create` "
                    "or pass --force", fg="red", err=True)
        raise typer.Exit(2)
    typer.echo(secret)


@plans_app.command("list")
def plans_list() -> None:
    _call("GET", "/plans", params={"limit": 200})


@plans_app.command("update")
def plans_update(name: str, fields: SetOption = None) -> None:
    """Change a plan, e.g. `--set daily_limit=100 --set timezone=Europe/Paris`."""
    _call("PATCH", f"/plans/{name}", _fields(fields))


@plans_app.command("create")
def plans_create(name: str, display_name: str, fields: SetOption = None) -> None:
    _call("POST", "/plans", {"name": name, "display_name": display_name, **_fields(fields)})


@models_app.command("list")
def models_list() -> None:
    _call("GET", "/models", params={"limit": 200})


IdleTimeout = Annotated[int | None, typer.Option(
    help="On demand: put its engines to sleep (stop them on a CPU host) after this many seconds unused "
         "(10 to 86400); without it, the fleet's default.")]


@models_app.command("add")
def models_add(name: str, source: Annotated[str, typer.Option(help="Local folder or hub id; a LoRA adapter's "
                                                                   "folder for a variant.")],
               option: Annotated[list[str] | None, typer.Option(help="Engine option FIELD=VALUE.")] = None,
               pinned: Annotated[bool, typer.Option(help="Keep it warm always (else: on demand).")] = False,
               min_workers: int = 0, idle_timeout_s: IdleTimeout = None,
               base_model: Annotated[str | None, typer.Option(
                   help="Make it a LoRA variant served by this catalog model's engines (which need "
                        "--option enable_lora=true).")] = None,
               trust_remote_code: Annotated[bool, typer.Option(
                   help="Let the model's repository run its own code in the workers (Kimi K2, ...).")] = False) -> None:
    body = {"name": name, "source": source, "engine_options": _fields(option), "pinned": pinned,
            "min_workers": min_workers, "trust_remote_code": trust_remote_code}
    body.update({k: v for k, v in (("idle_timeout_s", idle_timeout_s), ("base_model", base_model)) if v is not None})
    _call("POST", "/models", body)


@models_app.command("update")
def models_update(name: str, pinned: Annotated[bool | None, typer.Option(
                      "--pinned/--on-demand", help="Keep it warm always, or start it when asked for (a "
                                                   "min_workers above 0 keeps it up too).")] = None,
                  idle_timeout_s: IdleTimeout = None,
                  default_idle_timeout: Annotated[bool, typer.Option(
                      "--default-idle-timeout", help="Go back to the fleet's default idle timeout.")] = False,
                  fields: SetOption = None) -> None:
    """Change a catalog entry, e.g. `--on-demand --idle-timeout-s 600`, or any field with
    `--set FIELD=VALUE` (`--set base_model=llama-8b`, `--set 'engine_options={...}'`)."""
    body = _fields(fields)
    if pinned is not None:
        body["pinned"] = pinned
    if idle_timeout_s is not None and default_idle_timeout:
        raise typer.BadParameter("give --idle-timeout-s or --default-idle-timeout, not both")
    if idle_timeout_s is not None or default_idle_timeout:
        body["idle_timeout_s"] = idle_timeout_s
    _call("PATCH", f"/models/{name}", body)


@models_app.command("enable")
def models_enable(name: str) -> None:
    _call("PATCH", f"/models/{name}", {"enabled": True})


@models_app.command("disable")
def models_disable(name: str) -> None:
    """New requests for the model are refused; running ones finish."""
    _call("PATCH", f"/models/{name}", {"enabled": False})


@accounts_app.command("list")
def accounts_list(plan: str | None = None, status: str | None = None) -> None:
    _call("GET", "/accounts", params={"plan": plan, "status": status, "limit": 200})


@accounts_app.command("create")
def accounts_create(name: str, plan: str = "free") -> None:
    _call("POST", "/accounts", {"name": name, "plan": plan})


@accounts_app.command("update")
def accounts_update(account_id: int, fields: SetOption = None) -> None:
    """e.g. `--set plan=enterprise --set daily_limit_override=20000 --set max_inflight_override=256`."""
    _call("PATCH", f"/accounts/{account_id}", _fields(fields))


@accounts_app.command("suspend")
def accounts_suspend(account_id: int) -> None:
    _call("PATCH", f"/accounts/{account_id}", {"status": "suspended"})


@accounts_app.command("activate")
def accounts_activate(account_id: int) -> None:
    _call("PATCH", f"/accounts/{account_id}", {"status": "active"})


@keys_app.command("list")
def keys_list(account_id: int) -> None:
    _call("GET", f"/accounts/{account_id}/keys", params={"limit": 200})


@keys_app.command("create")
def keys_create(account_id: int, name: str = "",
                expires: Annotated[str | None, typer.Option(help="ISO time the key stops working.")] = None,
                model: Annotated[list[str] | None, typer.Option(
                    help="A model the key may use (repeat for more); without any, the plan decides.")] = None,
                daily_limit: Annotated[int | None, typer.Option(
                    min=1, help="Requests the key may make a day, within the account's limit.")] = None,
                max_inflight: Annotated[int | None, typer.Option(
                    min=1, max=100_000, help="Requests of the key queued or running at once; the account's cap "
                    "binds too (the lower one refuses).")] = None) -> None:
    body: dict[str, Any] = {"name": name, "expires_at": expires, "allowed_models": model or None,
                            "daily_limit": daily_limit, "max_inflight": max_inflight}
    _call("POST", f"/accounts/{account_id}/keys", body)


@keys_app.command("update")
def keys_update(key_id: int, fields: SetOption = None) -> None:
    """Change a key, e.g. `--set daily_limit=500 --set max_inflight=4 --set 'allowed_models=["m1"]'`;
    `--set daily_limit=null` clears a limit (the account's, the plan's models, no expiry)."""
    _call("PATCH", f"/keys/{key_id}", _fields(fields))


@keys_app.command("revoke")
def keys_revoke(key_id: int) -> None:
    _call("DELETE", f"/keys/{key_id}")


@keys_app.command("rotate")
def keys_rotate(key_id: int, grace_seconds: int = 86400) -> None:
    _call("POST", f"/keys/{key_id}/rotate", {"grace_seconds": grace_seconds})


@tokens_app.command("create")
def tokens_create(name: str, scope: Annotated[list[str], typer.Option(help="admin:read and/or admin:write")]) -> None:
    _call("POST", "/tokens", {"name": name, "scopes": scope})


@tokens_app.command("revoke")
def tokens_revoke(token_id: int) -> None:
    _call("DELETE", f"/tokens/{token_id}")


@app.command()
def usage(since: str | None = None, until: str | None = None, account_id: int | None = None,
          csv: Annotated[bool, typer.Option("--csv", help="CSV instead of JSON.")] = False) -> None:
    """Billable requests per day, account, key and model."""
    _call("GET", "/usage", params={"since": since, "until": until, "account_id": account_id,
                                   "format": "csv" if csv else "json"}, raw=csv)


@app.command()
def audit(limit: int = 50, action: str | None = None) -> None:
    """The newest admin writes first."""
    _call("GET", "/audit", params={"limit": limit, "action": action})
