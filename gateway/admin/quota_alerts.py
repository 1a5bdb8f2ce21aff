"""Admin routes for an account's quota alerts (:mod:`flatfare.gateway.quota_alerts`): read and set its
thresholds, email and webhook URL. The webhook's signing secret is never returned (only whether there is
one): the account's owner reads it in the console."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Request
from pydantic import BaseModel, Field

from flatfare.gateway.admin.auth import AdminReader, AdminWriter
from flatfare.gateway.admin.paging import RowId, not_found
from flatfare.gateway.admin.schemas import _In
from flatfare.gateway.admin.services import writing
from flatfare.gateway.app_state import services_of
from flatfare.gateway.errors import invalid
from flatfare.gateway.quota_alerts import (MAX_THRESHOLDS, AlertRules, AlertSettingsError, check_webhook_url,
                                           save_rules)
from flatfare.storage.audit import record
from flatfare.storage.models import Account, QuotaAlertSettings

router = APIRouter()
Percent = Annotated[int, Field(ge=1, le=100)]


class QuotaAlertsPublic(BaseModel):
    thresholds: list[int]
    email: bool
    webhook_url: str | None
    has_webhook_secret: bool


class QuotaAlertsUpdate(_In):
    thresholds: Annotated[list[Percent], Field(max_length=MAX_THRESHOLDS)]
    email: bool = True
    webhook_url: Annotated[str, Field(max_length=2048)] | None = None


def _public(rules: AlertRules) -> QuotaAlertsPublic:
    return QuotaAlertsPublic(thresholds=list(rules.thresholds), email=rules.email, webhook_url=rules.webhook_url,
                             has_webhook_secret=rules.webhook_secret is not None)


@router.get("/accounts/{account_id}/quota-alerts", response_model=QuotaAlertsPublic)
async def get_quota_alerts(request: Request, account_id: RowId, _: AdminReader) -> QuotaAlertsPublic:
    async with services_of(request).sessions() as session:
        if await session.get(Account, account_id) is None:
            raise not_found("account", account_id)
        return _public(AlertRules.of(await session.get(QuotaAlertSettings, account_id)))


@router.put("/accounts/{account_id}/quota-alerts", response_model=QuotaAlertsPublic)
async def set_quota_alerts(request: Request, account_id: RowId, body: QuotaAlertsUpdate,
                           admin: AdminWriter) -> QuotaAlertsPublic:
    """Replace the account's alerts (the webhook URL passes the console's check; a new one gets a secret)."""
    if body.webhook_url:
        try:
            await check_webhook_url(body.webhook_url, services_of(request).settings)
        except AlertSettingsError as exc:
            raise invalid(str(exc), param="webhook_url") from None
    rules = AlertRules(tuple(sorted(set(body.thresholds))), body.email, body.webhook_url or None)
    async with writing(services_of(request).sessions, admin) as session:
        if await session.get(Account, account_id) is None:
            raise not_found("account", account_id)
        before = await session.get(QuotaAlertSettings, account_id)
        shown_before = _public(AlertRules.of(before)).model_dump() if before is not None else None
        row = await save_rules(session, account_id, rules)
        after = _public(AlertRules.of(row))
        # The audit entry leaves the secret out, as the answer does.
        record(session, admin.actor, "account.quota_alerts", "account", account_id, shown_before, after.model_dump())
    return after
