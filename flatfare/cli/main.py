"""The ``flatfare`` command: the all-in-one platform and each part as its own process."""

from __future__ import annotations

import asyncio
import json
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Annotated, Any

import typer

from flatfare.cli.admin import app as admin_app
from flatfare.cli.console_users import app as console_users_app
from flatfare.cli.fleet import app as fleet_app
from flatfare.settings import DEFAULT_MODEL, CommonSettings

app = typer.Typer(help="Flatfare: an OpenAI-compatible LLM API with flat per-request pricing.",
                  no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False)
keys_app = typer.Typer(help="API keys.", no_args_is_help=True)
app.add_typer(keys_app, name="keys")
billing_app = typer.Typer(help="Usage reporting to Stripe.", no_args_is_help=True)
app.add_typer(billing_app, name="billing")
app.add_typer(admin_app, name="admin")
app.add_typer(console_users_app, name="console-users")
app.add_typer(fleet_app, name="fleet")


def _fail(message: str) -> None:
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    raise typer.Exit(2)


@app.command()
def up(
    model: Annotated[list[str] | None, typer.Option(
        help="A model to serve; repeat for more. Default: both built-in models. The first starts at once.")] = None,
    port: Annotated[int, typer.Option(help="Gateway port on 127.0.0.1.")] = 8000,
    on_demand: Annotated[bool, typer.Option(
        "--on-demand", help="Keep no model up, the catalog's pinned one included: each starts at its first "
        "request and stops when idle (the first model still starts at once).")] = False,
    max_awake: Annotated[int | None, typer.Option(
        min=1, help="Engines running at once. Default: one per model served; with --on-demand, 1 up to 4 "
        "cores, else 2.")] = None,
    idle_timeout: Annotated[float | None, typer.Option(
        min=1, help="Seconds an on-demand model's engine may sit idle before it stops (default 300).")] = None,
    payments: Annotated[str, typer.Option(
        help="'local': a Stripe stand-in on this machine (localstripe and a test Checkout page), to buy a plan "
        "in the console with a test card; 'none': billing is off.")] = "none",
    traces: Annotated[bool, typer.Option(
        "--traces", help="Send every request's spans over OTLP/HTTP to a collector on this machine "
        "(127.0.0.1:4318 unless FLATFARE_TRACES_ENDPOINT says otherwise); starts none: prints how.")] = False,
) -> None:
    """Start the whole platform locally: Redis, migrations, a fleet supervisor that starts the models'
    CPU workers (the first at once, the others at their first request) and the gateway."""
    from flatfare.cli.up import UpOptions, run_up

    if payments not in ("none", "local"):
        _fail(f"--payments is 'none' or 'local', not {payments!r}")
    sys.exit(run_up(UpOptions(models=model, port=port, on_demand=on_demand, max_awake=max_awake,
                              idle_timeout_s=idle_timeout, payments=payments,
                              traces=traces)))


@app.command()
def gateway(
    host: Annotated[str | None, typer.Option(help="Interface to listen on.")] = None,
    port: Annotated[int | None, typer.Option(help="Port to listen on.")] = None,
    processes: Annotated[int, typer.Option(help="Gateway processes sharing the port.")] = 1,
    server: Annotated[str | None, typer.Option(help="HTTP server: uvicorn (httptools) or granian (Rust).")] = None,
) -> None:
    """Run the gateway (FLATFARE_DATABASE_URL, FLATFARE_REDIS_URL)."""
    from flatfare.gateway.settings import GatewaySettings

    overrides: dict[str, Any] = {k: v for k, v in {"host": host, "port": port, "server": server}.items()
                                 if v is not None}
    settings = GatewaySettings(**overrides)
    if not settings.redis_url:
        _fail("set FLATFARE_REDIS_URL: the gateway needs the Redis its workers use")
    # Child processes rebuild settings from the environment, so pass overrides through it.
    import os

    os.environ.update({f"FLATFARE_{k.upper()}": str(v) for k, v in overrides.items()})
    from flatfare.logs import configure_logging

    configure_logging(settings.log_level, settings.log_format, log_prompts=settings.log_prompts)
    # prometheus_client picks multiprocess mode at import, from this variable: set it before anything
    # imports it, so every gateway process writes its samples where /metrics reads them all.
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(_metrics_dir(settings.metrics_dir))
    if settings.server == "granian":
        from granian import Granian

        Granian("flatfare.cli.main:granian_gateway_app", address=settings.host, port=settings.port, interface="asgi",
                workers=processes, factory=True, loop="uvloop", log_enabled=False, backlog=4096).serve()
        return
    import uvicorn

    uvicorn.run("flatfare.gateway.app:create_app", factory=True, host=settings.host, port=settings.port,
                workers=processes, log_level=settings.log_level, access_log=False, log_config=None,
                proxy_headers=True, forwarded_allow_ips=settings.forwarded_allow_ips,
                timeout_keep_alive=settings.keep_alive_s)


def granian_gateway_app() -> Any:
    """The gateway for granian, which reads X-Forwarded-For only through its wrapper: from the trusted
    proxies of FLATFARE_FORWARDED_ALLOW_IPS, as uvicorn does."""
    from granian.utils.proxies import wrap_asgi_with_proxy_headers

    from flatfare.gateway.app import create_app
    from flatfare.gateway.settings import GatewaySettings

    settings = GatewaySettings()
    trusted = [host.strip() for host in settings.forwarded_allow_ips.split(",") if host.strip()]
    return wrap_asgi_with_proxy_headers(create_app(settings), trusted_hosts=trusted)


def _metrics_dir(configured: str) -> Path:
    """An empty folder for the gateway processes' metric files: ``configured`` with old files removed
    (counters must restart with the processes), or a temporary one removed at exit."""
    import atexit
    import shutil
    import tempfile

    if not configured:
        folder = Path(tempfile.mkdtemp(prefix="flatfare-metrics-"))
        atexit.register(shutil.rmtree, folder, ignore_errors=True)
        return folder
    folder = Path(configured)
    folder.mkdir(parents=True, exist_ok=True)
    for stale in folder.glob("*.db"):
        stale.unlink()
    return folder


@app.command()
def worker(
    model: Annotated[str, typer.Option(help="Catalog name of the model to serve.")] = DEFAULT_MODEL,
    source: Annotated[str | None, typer.Option(help="Folder or hub id, for a model not in the catalog.")] = None,
    engine_options: Annotated[str | None, typer.Option(
        help='JSON object of vLLM engine options overriding the catalog, e.g. \'{"max_model_len": 4096}\'.')] = None,
    max_inflight: Annotated[int | None, typer.Option(help="Jobs held at once (default: engine capacity).")] = None,
    engine: Annotated[str | None, typer.Option(
        help="'vllm', or 'instant': a benchmark/test engine answering at once with no model.")] = None,
    pool: Annotated[str | None, typer.Option(help="A dedicated pool (an enterprise account's) to serve.")] = None,
    fleet: Annotated[str | None, typer.Option(
        help="The fleet supervisor starting this worker (FLATFARE_FLEET_ID), named in its heartbeat.")] = None,
) -> None:
    """Run one worker: an embedded vLLM engine serving one model's pool."""
    import os

    # A worker is one process: its metrics (and vLLM's) stay in memory. A multiprocess folder meant for
    # gateways would make prometheus_client write them to files that no /metrics of the worker reads.
    os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)
    from flatfare.workers.main import WorkerError, main
    from flatfare.workers.settings import WorkerSettings

    overrides: dict[str, Any] = {"model": model}
    if source:
        overrides["source"] = source
    if engine_options:
        try:
            overrides["engine_options"] = json.loads(engine_options)
        except json.JSONDecodeError as exc:
            _fail(f"--engine-options is not JSON: {exc}")
    if max_inflight is not None:
        overrides["max_inflight"] = max_inflight
    if engine is not None:
        overrides["engine"] = engine
    if pool:
        overrides["pool"] = pool
    if fleet:
        overrides["fleet_id"] = fleet
    try:
        main(WorkerSettings(**overrides))
    except WorkerError as exc:
        _fail(str(exc))


@app.command()
def migrate(revision: Annotated[str, typer.Argument(help="Target revision.")] = "head") -> None:
    """Apply the database migrations (FLATFARE_DATABASE_URL, default a SQLite file)."""
    from flatfare.storage.db import migrate as run_migrations

    run_migrations(CommonSettings().resolved_database_url, revision)


ExpiresOption = Annotated[str | None, typer.Option(
    "--expires", help="When the key stops working: an ISO time (UTC unless it says otherwise) or a span "
    "from now such as 30d, 12h, 90m.")]
ModelOption = Annotated[list[str] | None, typer.Option(
    "--model", help="A model the key may use (repeat for more); without any, the plan decides.")]
DailyLimitOption = Annotated[int | None, typer.Option(
    "--daily-limit", min=1, help="Requests the key may make a day, within the account's limit.")]
MaxInflightOption = Annotated[int | None, typer.Option(
    "--max-inflight", min=1, max=100_000, help="Requests of the key queued or running at once; the account's "
    "cap binds too (the lower one refuses).")]


@keys_app.command("create")
def keys_create(
    account: Annotated[str, typer.Option(help="Account name; created if it does not exist.")],
    plan: Annotated[str | None, typer.Option(help="Plan for the account (default: free for new accounts).")] = None,
    name: Annotated[str, typer.Option(help="A label for the key.")] = "",
    expires: ExpiresOption = None,
    model: ModelOption = None,
    daily_limit: DailyLimitOption = None,
    max_inflight: MaxInflightOption = None,
) -> None:
    """Create an API key and print it, alone, on stdout."""
    from flatfare.storage.accounts import AccountError, KeyLimitsUpdate
    from flatfare.cli.keys import create_key

    limits = KeyLimitsUpdate(expires_at=_expiry(expires) if expires else None, allowed_models=_models(model),
                             daily_limit=daily_limit, max_inflight=max_inflight)
    try:
        secret = asyncio.run(create_key(CommonSettings().resolved_database_url, account, plan, name, limits))
    except AccountError as exc:
        _fail(str(exc))
    typer.echo(secret)


@keys_app.command("update")
def keys_update(
    key: Annotated[str, typer.Argument(help="The key's id, its prefix (ff- and 8 characters) or the key.")],
    name: Annotated[str | None, typer.Option(help="A new label.")] = None,
    expires: ExpiresOption = None,
    no_expiry: Annotated[bool, typer.Option("--no-expiry", help="Never expire.")] = False,
    model: ModelOption = None,
    all_models: Annotated[bool, typer.Option("--all-models", help="Drop the key's model list.")] = False,
    daily_limit: DailyLimitOption = None,
    no_daily_limit: Annotated[bool, typer.Option("--no-daily-limit", help="Only the account's limit.")] = False,
    max_inflight: MaxInflightOption = None,
    no_max_inflight: Annotated[bool, typer.Option("--no-max-inflight", help="Only the account's cap.")] = False,
) -> None:
    """Change a key's name, expiry, models, daily limit or in-flight cap (what is not given stays); prints
    the key."""
    from flatfare.storage.accounts import UNSET, AccountError, KeyLimitsUpdate, update_key

    for given, cleared, option in ((expires, no_expiry, "--expires"), (model, all_models, "--model"),
                                   (daily_limit, no_daily_limit, "--daily-limit"),
                                   (max_inflight, no_max_inflight, "--max-inflight")):
        if given and cleared:
            _fail(f"{option} and its clearing option contradict each other; give one")
    limits = KeyLimitsUpdate(
        name=UNSET if name is None else name,
        expires_at=None if no_expiry else (_expiry(expires) if expires else UNSET),
        allowed_models=None if all_models else (_models(model) or UNSET),
        daily_limit=None if no_daily_limit else (UNSET if daily_limit is None else daily_limit),
        max_inflight=None if no_max_inflight else (UNSET if max_inflight is None else max_inflight))
    try:
        row = asyncio.run(update_key(CommonSettings().resolved_database_url, key, limits))
    except AccountError as exc:
        _fail(str(exc))
    typer.echo(json.dumps({"id": row.id, "account_id": row.account_id, "name": row.name, "prefix": row.prefix,
                           "expires_at": row.expires_at.isoformat() if row.expires_at else None,
                           "allowed_models": row.allowed_models, "daily_limit": row.daily_limit,
                           "max_inflight": row.max_inflight}, indent=2))


def _expiry(text: str) -> datetime:
    """``--expires``: an ISO time (UTC unless it names its zone) or a span from now (30d, 12h, 90m)."""
    spans = {"d": "days", "h": "hours", "m": "minutes"}
    if text[:-1].isdigit() and text[-1:] in spans:
        return datetime.now(UTC) + timedelta(**{spans[text[-1]]: int(text[:-1])})
    try:
        when = datetime.fromisoformat(text)
    except ValueError:
        _fail(f"--expires takes an ISO time such as 2027-01-31T00:00Z or a span such as 30d, not {text!r}")
    return when if when.tzinfo else when.replace(tzinfo=UTC)


def _models(names: list[str] | None) -> list[str] | None:
    """``--model`` values, once each, in order; None without any."""
    models = list(dict.fromkeys(name.strip() for name in names or []))
    if any(not name for name in models):
        _fail("--model takes a model's name; it cannot be empty")
    return models or None


@billing_app.command("reconcile")
def billing_reconcile(day: Annotated[str, typer.Option(help="Quota day, YYYY-MM-DD.")]) -> None:
    """Compare the day's billable ledger rows with the meter-event outbox and queue what is missing."""
    from datetime import date

    from flatfare.billing.outbox import reconcile
    from flatfare.storage.db import brief_sessions

    try:
        date.fromisoformat(day)
    except ValueError:
        _fail(f"--day must look like 2026-12-02, not {day!r}")

    async def run() -> None:
        async with brief_sessions(CommonSettings().resolved_database_url) as sessions:
            result = await reconcile(sessions, day)
        typer.echo(f"day {result.day}: {result.billable} billable requests, {result.in_outbox} in the outbox "
                   f"({result.sent} sent), {result.repaired} missing rows queued")

    asyncio.run(run())


@billing_app.command("send-usage")
def billing_send_usage() -> None:
    """Send every due meter event now (the gateway also does this continuously)."""
    from flatfare.billing.outbox import OutboxSender
    from flatfare.billing.stripe_client import StripeGateway
    from flatfare.storage.db import brief_sessions
    from flatfare.gateway.settings import GatewaySettings

    settings = GatewaySettings()
    if not settings.stripe_enabled:
        _fail("set FLATFARE_STRIPE_API_KEY and FLATFARE_STRIPE_WEBHOOK_SECRET")

    async def run() -> int:
        async with brief_sessions(settings.resolved_database_url) as sessions:
            return await OutboxSender(sessions, StripeGateway(settings.stripe_config())).send_due()

    typer.echo(f"{asyncio.run(run())} meter events sent")


def main() -> None:
    app()
