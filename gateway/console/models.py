"""The models a console customer may pick: what ``/v1/models`` would list for the account's plan."""

from __future__ import annotations

from datetime import UTC, datetime

from fastapi import Request

from flatfare.storage.models import Account


async def plan_models(request: Request, account: Account) -> list[str]:
    """Names of the models served or expected now that the account's plan (and the catalog entry's own
    plan list) allows, sorted."""
    state = request.app.state
    plan = (await state.plans.terms(account, datetime.now(UTC))).plan
    catalog = await state.pools.catalog()
    names = []
    for name in await state.pools.model_states():
        entry = catalog.get(name)
        if plan.allows_model(name) and (entry is None or entry.allows_plan(plan.name)):
            names.append(name)
    return sorted(names)
