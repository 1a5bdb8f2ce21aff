"""``create_app(settings)``: the gateway's ASGI application (FastAPI behind the completion routes) and the
lifespan that owns its clients."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import timedelta

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
from flatfare.gateway import admin, batches, billing_routes, console, files, health, usage
from flatfare.gateway.openai import routes
from flatfare.gateway.admin.auth import AdminAuthenticator
from flatfare.gateway.auth import Authenticator
from flatfare.gateway.openai.service import CompletionService
from flatfare.gateway.errors import install_handlers
from flatfare.billing.held import HeldUnits
from flatfare.gateway.metrics import GatewayMetrics, RequestObserver
from flatfare.gateway.metrics import router as metrics_router
from flatfare.gateway.openai.asgi import CompletionRoutes
from flatfare.gateway.prefix_routing import PrefixRouter
from flatfare.gateway.plans import PlanBook
from flatfare.gateway.responses import routes as responses_routes
from flatfare.gateway.responses.service import ResponsesService
from flatfare.gateway.responses.store import ResponseStore
from flatfare.gateway.queueing import LaneLimits, LaneQueue
from flatfare.gateway.pools import Pools
from flatfare.gateway.quota_headers import RateLimitHeaders
from flatfare.gateway.replies import Replies, ReplyRouter
from flatfare.gateway.openai.screen import RequestScreen
from flatfare.gateway.settings import GatewaySettings
from flatfare.gateway.tokenizer_cache import Tokenizers


def create_app(settings: GatewaySettings | None = None) -> CompletionRoutes:
    settings = settings or GatewaySettings()
    if not settings.redis_url:
        raise RuntimeError("set FLATFARE_REDIS_URL: the gateway needs the Redis its workers use")
    configure_logging(settings.log_level, settings.log_format, log_prompts=settings.log_prompts)
    metrics = GatewayMetrics()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine = create_engine(settings.resolved_database_url, pool_size=settings.db_pool_size)
        redis = connect(settings.redis_url)
        sessions = session_factory(engine)
        state = app.state
        state.settings = settings
        state.redis = redis
        state.sessions = sessions
        state.authenticator = Authenticator(sessions, settings.auth_cache_ttl_s)
        state.admin_auth = AdminAuthenticator(sessions, settings.auth_cache_ttl_s)
        state.pools = Pools(redis, sessions, settings.pools_cache_ttl_s, settings.external_scaler)
        ledger = Ledger(sessions)
        state.plans = PlanBook(sessions, settings.plans_cache_ttl_s)
        state.quota = DailyQuota(redis, ledger.billable_counts, ledger.billable_key_counts)
        state.ledger = ledger
        limits = {Lane.PREMIUM: LaneLimits(settings.max_queue_depth_premium, settings.max_queue_wait_s_premium),
                  Lane.STANDARD: LaneLimits(settings.max_queue_depth_standard, settings.max_queue_wait_s_standard)}
        router = ReplyRouter(redis, settings.request_timeout_s, lost_after_s=settings.lost_job_after_s)
        router.start()
        held = HeldUnits(redis, router.gateway_id, ledger, state.quota, settings.gateway_dead_after_s)
        held.start()
        state.completions = CompletionService(
            state.pools, router, Replies(redis), ledger, state.plans, state.quota,
            LaneQueue(redis, limits, state.quota, held.key), PrefixRouter(redis, settings.prefix_routing), held,
            metrics, RequestScreen(redis), Tokenizers(redis, settings.pools_cache_ttl_s), settings.cold_start_timeout_s)
        state.response_store = ResponseStore(sessions, timedelta(days=settings.responses_retention_days))
        state.responses = ResponsesService(state.completions, state.response_store)
        state.accounts = AccountStore(sessions)
        console.start(app, settings, redis)
        state.stripe = None
        state.webhooks = WebhookProcessor(sessions, {price: plan for plan, price in settings.stripe_prices.items()})
        stop = asyncio.Event()
        background: list[asyncio.Task[None]] = []
        background.append(files.start(state, settings, sessions, stop))
        background.append(batches.start(state, redis, sessions, stop))
        background.append(asyncio.create_task(expire_every(stop, settings.files_sweep_interval_s,
                                                           state.response_store.purge_expired, "responses")))
        if settings.stripe_enabled:
            state.stripe = StripeGateway(settings.stripe_config())
            sender = OutboxSender(sessions, state.stripe, settings.billing_outbox_max_backoff_s)
            background.append(asyncio.create_task(sender.run(redis, stop, settings.billing_outbox_interval_s)))
        try:
            yield
        finally:
            stop.set()
            await asyncio.gather(*background, return_exceptions=True)
            await router.stop()
            await held.stop()
            ledger.dispose()
            await redis.aclose()
            await engine.dispose()

    # redirect_slashes off: its redirect built Location from the client's Host header.
    app = FastAPI(title="Flatfare", version="0.1.0", lifespan=lifespan, redirect_slashes=False,
                  description="OpenAI-compatible LLM API with flat per-request pricing.")
    app.state.metrics = metrics
    install_handlers(app)
    app.add_middleware(RateLimitHeaders)
    app.add_middleware(RequestObserver, metrics=metrics)
    app.include_router(routes.router)
    app.include_router(responses_routes.router)
    app.include_router(usage.router)
    app.include_router(files.router)
    app.include_router(batches.router)
    app.include_router(billing_routes.router)
    app.include_router(admin.router)
    app.include_router(health.router)
    app.include_router(metrics_router)
    console.install(app, settings)
    # The two completion routes are served in front of FastAPI, outside its routing and middlewares.
    return CompletionRoutes(app, metrics)
