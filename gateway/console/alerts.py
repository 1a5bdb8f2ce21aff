"""The customer's quota alerts page: the thresholds (percents of the daily quota), email on or off, an
optional webhook (its URL checked as :mod:`flatfare.gateway.quota_alerts` posts to it, its signing secret
made by Flatfare and shown here), and the log of the account's last deliveries. The alerts are sent by the
background pass of :mod:`flatfare.gateway.quota_alerts`, never here."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import RedirectResponse, Response
from sqlalchemy import select

from flatfare.gateway.app_state import services_of
from flatfare.gateway.console.deps import ConsoleForm, Customer, UsageMember
from flatfare.gateway.console.pages import render
from flatfare.gateway.quota_alerts import (AlertRules, AlertSettingsError, check_webhook_url, parse_thresholds,
                                           save_rules)
from flatfare.storage.models import QuotaAlertDelivery, QuotaAlertSettings

router = APIRouter(prefix="/console", include_in_schema=False)
LOG_ROWS = 50
MAX_URL_CHARS = 2048
FLASHES = {"saved": "Your alerts were saved.", "secret": "A new webhook secret was made: update your receiver."}


async def _view(request: Request, customer: Customer) -> dict[str, Any]:
    async with services_of(request).sessions() as db:
        rules = AlertRules.of(await db.get(QuotaAlertSettings, customer.account.id))
        log = list(await db.scalars(select(QuotaAlertDelivery).where(
            QuotaAlertDelivery.account_id == customer.account.id)
            .order_by(QuotaAlertDelivery.id.desc()).limit(LOG_ROWS)))
    done = FLASHES.get(request.query_params.get("done", ""))
    return {"customer": customer, "rules": rules, "deliveries": log,
            "thresholds_text": ", ".join(str(t) for t in rules.thresholds), **({"flash": done} if done else {})}


@router.get("/alerts")
async def alerts_page(request: Request, customer: UsageMember) -> Response:
    return render(request, "alerts.html", await _view(request, customer))


@router.post("/alerts")
async def save_alerts(request: Request, customer: UsageMember, form: ConsoleForm) -> Response:
    settings = services_of(request).settings
    url = form.get("webhook_url", "").strip()
    try:
        thresholds = parse_thresholds(form.get("thresholds", ""))
        if len(url) > MAX_URL_CHARS:
            raise AlertSettingsError(f"The webhook URL is longer than {MAX_URL_CHARS} characters.")
        if url:
            await check_webhook_url(url, settings)
    except AlertSettingsError as exc:
        view = await _view(request, customer)
        view.update(error=str(exc), thresholds_text=form.get("thresholds", "")[:200], typed_url=url[:MAX_URL_CHARS])
        return render(request, "alerts.html", view, status_code=400)
    async with services_of(request).sessions() as db, db.begin():
        await save_rules(db, customer.account.id, AlertRules(thresholds, form.get("email") == "on", url or None),
                         roll_secret=form.get("roll_secret") == "on")
    return RedirectResponse("/console/alerts?done=saved", status_code=303)
