"""The gateway process's services, typed: built once by the lifespan (:func:`flatfare.gateway.app.create_app`),
kept on the app as ``app.state.services``, and read by every route and dependency through
`services_of(request)` (never through untyped ``app.state`` attributes)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from starlette.requests import HTTPConnection

if TYPE_CHECKING:  # the services' own modules import the routes' helpers: no import at run time
    from fastapi.templating import Jinja2Templates
    from redis.asyncio import Redis
    from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

    from flatfare.billing.ledger import Ledger
    from flatfare.billing.quota import DailyQuota
    from flatfare.billing.stripe_client import StripeGateway
    from flatfare.billing.webhooks import WebhookProcessor
    from flatfare.gateway.admin.auth import AdminAuthenticator
    from flatfare.gateway.auth import Authenticator
    from flatfare.gateway.batches.service import BatchService
    from flatfare.gateway.console.sessions import ConsoleSessions
    from flatfare.gateway.files.service import FileService
    from flatfare.gateway.metrics import GatewayMetrics
    from flatfare.gateway.platform_metrics import LedgerWatch
    from flatfare.gateway.openai.service import CompletionService
    from flatfare.gateway.jobpath.plan_cache import PlanBook
    from flatfare.gateway.jobpath.pools import Pools
    from flatfare.gateway.responses.store import ResponseStore
    from flatfare.gateway.settings import GatewaySettings
    from flatfare.gateway.shared_keys import SharedKeys
    from flatfare.storage.accounts import AccountStore


@dataclass(slots=True)
class Services:
    settings: GatewaySettings
    metrics: GatewayMetrics
    redis: Redis
    sessions: async_sessionmaker[AsyncSession]
    authenticator: Authenticator
    admin_auth: AdminAuthenticator
    pools: Pools
    plans: PlanBook
    quota: DailyQuota
    ledger: Ledger
    completions: CompletionService
    response_store: ResponseStore
    accounts: AccountStore
    webhooks: WebhookProcessor
    files: FileService
    batches: BatchService
    console_sessions: ConsoleSessions
    console_templates: Jinja2Templates
    # What /metrics reads of the last day's ledger rows, at most every FLATFARE_METRICS_LEDGER_EVERY_S.
    ledger_watch: LedgerWatch
    # Shared-key detection: the keyed hashes the admission records, and the counts the consoles read.
    shared_keys: SharedKeys
    # None: billing through Stripe is not configured (its routes answer 503).
    stripe: StripeGateway | None = None


def services_of(connection: HTTPConnection) -> Services:
    """The services of the app serving ``connection`` (a request)."""
    return connection.app.state.services
