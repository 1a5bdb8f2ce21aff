"""``create_app(settings)``: the gateway's ASGI application (FastAPI behind the completion routes) and the
lifespan that owns its clients."""

from __future__ import annotations

import asyncio
import gc
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import timedelta

from flatfare import tracing
from flatfare.logs import configure_logging
from flatfare.contract import Lane
from flatfare.redis_conn import connect
from fastapi import FastAPI

from flatfare.billing.ledger import Ledger
from flatfare.billing.outbox import OutboxSender
from flatfare.billing.stripe_client import StripeGateway
from flatfare.billing.webhooks import WebhookProcessor
from flatfare.storage.accounts import AccountStore
from flatfare.billing.quota import DailyQuota
from flatfare.storage.db import create_engine, expire_every, session_factory
from flatfare.gateway import admin, batches, billing_routes, console, files, health, usage_api
from flatfare.gateway.openai import routes
from flatfare.gateway.admin.auth import AdminAuthenticator
from flatfare.gateway.app_state import Services
from flatfare.gateway.console.pages import build_templates
from flatfare.gateway.auth import Authenticator
from flatfare.gateway.openai.admission import Admission
from flatfare.gateway.openai.relay import Relay
from flatfare.gateway.openai.service import CompletionService
from flatfare.gateway.openai.settlement import Settlement
from flatfare.gateway.errors import install_handlers
from flatfare.billing.held import LOST_CODE, HeldUnits
from flatfare.gateway.metrics import GatewayMetrics, RequestObserver
from flatfare.gateway.metrics import router as metrics_router
from flatfare.gateway.platform_metrics import LedgerWatch
from flatfare.gateway.openai.asgi import CompletionRoutes
from flatfare.gateway.jobpath.prefix_routing import PrefixRouter
from flatfare.gateway.jobpath.plan_cache import PlanBook
from flatfare.gateway.responses import routes as responses_routes
from flatfare.gateway.responses.store import ResponseStore
from flatfare.gateway.jobpath.queueing import LaneLimits, LaneQueue
from flatfare.gateway.jobpath.pools import Pools
from flatfare.gateway.quota_headers import RateLimitHeaders
from flatfare.gateway.jobpath.replies import Replies, ReplyRouter
from flatfare.gateway.openai.screen import RequestScreen
from flatfare.gateway.settings import GatewaySettings
from flatfare.gateway.shared_keys import SharedKeys
from flatfare.gateway.console import shared_key_notice
from flatfare.gateway.quota_alerts import QuotaAlerts
from flatfare.gateway.jobpath.tokenizer_cache import Tokenizers

log = logging.getLogger(__name__)

# The cyclic garbage collector's thresholds in a gateway process (CPython's defaults: 700, 10, 10).
GC_THRESHOLDS = (10_000, 10, 10)


async def _stop(background: list[asyncio.Task[None]], grace_s: float) -> None:
    """Each background pass ends at its next look at ``stop``; one still inside a pass after ``grace_s``
    (a database lock, a slow webhook) is cancelled, so shutdown always ends. Each pass is written to be
    cut anywhere: its work is in SQL or Redis and the next process's pass takes it up."""
    _, late = await asyncio.wait(background, timeout=grace_s)
    for task in late:
        log.warning("background pass %s still running %.0f s after shutdown began: cancelled", task.get_name(), grace_s)
        task.cancel()
    await asyncio.gather(*background, return_exceptions=True)


def tune_collector() -> None:
    """Freeze what the start built, and collect the young generation every 10,000 allocations, not 700.

    A request allocates a few hundred short-lived containers, nearly all freed by reference counting:
    at the default threshold a collection ran every few requests, and every hundredth walked the whole
    heap the start built (FastAPI, pydantic, SQLAlchemy, the routes): together ~a fifth of the
    gateway's CPU at 32 clients (docs/PERFORMANCE.md, round 3). Frozen, that heap is never walked
    again; garbage cycles are still collected, a little later. The collector is the process's: its
    start is frozen once, by whichever app's lifespan comes first (the tests run many in one process)."""
    gc.set_threshold(*GC_THRESHOLDS)
    if not gc.get_freeze_count():
        gc.collect()
        gc.freeze()


def create_app(settings: GatewaySettings | None = None) -> CompletionRoutes:
    settings = settings or GatewaySettings()
    if not settings.redis_url:
        raise RuntimeError("set FLATFARE_REDIS_URL: the gateway needs the Redis its workers use")
    configure_logging(settings.log_level, settings.log_format, log_prompts=settings.log_prompts)
    metrics = GatewayMetrics()
    # Flatfare's spans (None: tracing off); its export thread is this process's, stopped with the lifespan.
    tracer = tracing.tracer("flatfare-gateway", settings.traces_endpoint, settings.traces_sample_ratio)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine = create_engine(settings.resolved_database_url, pool_size=settings.db_pool_size)
        redis = connect(settings.redis_url)
        sessions = session_factory(engine)
        pools = Pools(redis, sessions, settings.pools_cache_ttl_s, settings.external_scaler)
        ledger = Ledger(sessions)
        plans = PlanBook(sessions, settings.plans_cache_ttl_s)
        quota = DailyQuota(redis, ledger.billable_counts, ledger.billable_key_counts)
        limits = {Lane.PREMIUM: LaneLimits(settings.max_queue_depth_premium, settings.max_queue_wait_s_premium),
                  Lane.STANDARD: LaneLimits(settings.max_queue_depth_standard, settings.max_queue_wait_s_standard)}
        router = ReplyRouter(redis, settings.request_timeout_s, lost_after_s=settings.lost_job_after_s)
        router.start()
        held = HeldUnits(redis, router.gateway_id, ledger, quota, settings.gateway_dead_after_s,
                         on_lost=lambda requests: metrics.lost(LOST_CODE, requests))
        held.start()
        response_store = ResponseStore(sessions, timedelta(days=settings.responses_retention_days))
        admission = Admission(pools, RequestScreen(redis), Tokenizers(redis, settings.pools_cache_ttl_s), response_store)
        replies = Replies(redis)
        queue = LaneQueue(redis, limits, quota, held.key)
        settlement = Settlement(ledger, quota, held, replies, metrics, settings.idempotency_window_s)
        relay = Relay(router, queue, pools, settlement, metrics, int(settings.cold_start_timeout_s * 1000))
        shared_keys = SharedKeys(redis, settings.shared_keys_keep_days, settings.shared_keys_window_s,
                                 settings.shared_keys_secret.get_secret_value())
        await shared_keys.start_if_reachable()
        completions = CompletionService(admission, plans, router, replies, ledger, queue,
                                        PrefixRouter(redis, settings.prefix_routing), held, settlement, relay, metrics,
                                        shared_keys)
        stop = asyncio.Event()
        file_service, sweeping = files.start(settings, sessions, stop)
        batch_service, dispatching = batches.start(redis, sessions, file_service, pools, admission, plans, stop,
                                                   on_line=metrics.batch_line, tracer=tracer)
        background = [sweeping, dispatching, asyncio.create_task(expire_every(
            stop, settings.files_sweep_interval_s, response_store.purge_expired, "responses"), name="responses-expiry")]
        stripe = StripeGateway(settings.stripe_config()) if settings.stripe_enabled else None
        if stripe is not None:
            sender = OutboxSender(sessions, stripe, settings.billing_outbox_max_backoff_s, tracer=tracer,
                                  concurrency=settings.billing_outbox_concurrency)
            background.append(asyncio.create_task(sender.run(redis, stop, settings.billing_outbox_interval_s),
                                                  name="billing-outbox"))
        app.state.services = Services(
            settings=settings, metrics=metrics, redis=redis, sessions=sessions,
            authenticator=Authenticator(sessions, settings.auth_cache_ttl_s),
            admin_auth=AdminAuthenticator(sessions, settings.auth_cache_ttl_s), pools=pools, plans=plans, quota=quota,
            ledger=ledger, completions=completions, response_store=response_store, accounts=AccountStore(sessions),
            webhooks=WebhookProcessor(sessions, {price: plan for plan, price in settings.stripe_prices.items()}),
            files=file_service, batches=batch_service, console_sessions=console.sessions(settings, redis),
            console_templates=build_templates(), ledger_watch=LedgerWatch(settings.metrics_ledger_every_s),
            shared_keys=shared_keys, stripe=stripe)
        background.append(asyncio.create_task(shared_key_notice.run(app.state.services, stop,
                                                                    settings.shared_keys_check_every_s),
                                              name="shared-key-notices"))
        alerts = QuotaAlerts(sessions, quota, plans, settings)
        background.append(asyncio.create_task(alerts.run(redis, stop), name="quota-alerts"))
        tune_collector()
        try:
            yield
        finally:
            stop.set()
            await _stop(background, settings.shutdown_grace_s)
            await router.stop()
            await held.stop()
            ledger.dispose()
            await redis.aclose()
            await engine.dispose()
            if tracer is not None:
                tracer.shutdown()

    # redirect_slashes off: its redirect built Location from the client's Host header.
    app = FastAPI(title="Flatfare", version="0.1.0", lifespan=lifespan, redirect_slashes=False,
                  description="OpenAI-compatible LLM API with flat per-request pricing.")
    install_handlers(app)
    app.add_middleware(RateLimitHeaders)
    app.add_middleware(RequestObserver, metrics=metrics, tracer=tracer)
    app.include_router(routes.router)
    app.include_router(responses_routes.router)
    app.include_router(usage_api.router)
    app.include_router(files.router)
    app.include_router(batches.router)
    app.include_router(billing_routes.router)
    app.include_router(admin.router)
    app.include_router(health.router)
    app.include_router(metrics_router)
    console.install(app, settings)
    # The two completion routes are served in front of FastAPI, outside its routing and middlewares.
    return CompletionRoutes(app, metrics, tracer)
