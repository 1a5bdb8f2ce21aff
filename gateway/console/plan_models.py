"""The models a console customer may pick: what ``/v1/models`` would list for the account's plan."""

from __future__ import annotations

from datetime import UTC, datetime

from fastapi import Request

from flatfare.storage.models import Account
from flatfare.gateway.app_state import services_of


async def plan_models(request: Request, account: Account, *, chat: bool = False) -> list[str]:
    """Names of the models served or expected now that the account's plan (and the catalog entry's own
    plan list) allows, sorted. ``chat``: only the models that generate text (an embedding model answers
    /v1/embeddings only, so a chat snippet or the Playground must never name it), the platform's default
    chat model (``console_default_model``) first when the plan has it."""
    state = services_of(request)
    plan = (await state.plans.terms(account, datetime.now(UTC))).plan
    catalog = await state.pools.catalog()
    names = []
    for name in await state.pools.model_states():
        entry = catalog.get(name)
        if plan.allows_model(name) and (entry is None or entry.allows_plan(plan.name)):
            if chat and entry is not None and entry.capabilities.embeddings:
                continue
            names.append(name)
    names.sort()
    if chat:
        default = state.settings.console_default_model
        names.sort(key=lambda name: name != default)  # stable: the rest stay by name
    return names
