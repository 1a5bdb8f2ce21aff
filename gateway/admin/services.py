"""The admin writes, as plain functions of a session: the admin API's routes and the admin console
call these same ones, so a plan, an account or a catalog entry changes one way only, and every
change is audited in the transaction that makes it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from flatfare.storage.accounts import AccountError, ensure_account
from flatfare.storage.models import Account, CatalogModel, Plan
from flatfare.gateway.admin.audit import not_found, record, snapshot
from flatfare.gateway.admin.auth import Admin
from flatfare.gateway.admin.catalog_schemas import ModelCreate, ModelUpdate
from flatfare.gateway.admin.model_options import EngineOptions
from flatfare.gateway.admin.schemas import AccountCreate, AccountUpdate, PlanCreate, PlanUpdate
from flatfare.gateway.errors import APIError

Sessions = async_sessionmaker[AsyncSession]

_PLAN_DEFAULTS: dict[str, Any] = {
    "daily_limit": None, "price_per_request_micros": 0, "monthly_price_cents": 0, "lane": "standard",
    "max_n": 1, "max_body_bytes": 1_048_576, "max_prompt_tokens": None, "max_inflight": None,
    "timezone": "UTC", "retired": False}


# -- plans -------------------------------------------------------------------------------------

async def create_plan(sessions: Sessions, admin: Admin, body: PlanCreate) -> Plan:
    async with sessions() as session, session.begin():
        if await session.get(Plan, body.name) is not None:
            raise APIError(409, f"A plan named '{body.name}' exists.", param="name", code="plan_exists")
        plan = Plan(**{**_PLAN_DEFAULTS, **body.model_dump(exclude_unset=True)})
        session.add(plan)
        await session.flush()
        record(session, admin, "plan.create", "plan", plan.name, None, snapshot(plan))
    return plan


async def update_plan(sessions: Sessions, admin: Admin, name: str, body: PlanUpdate) -> Plan:
    """Apply the fields ``body`` sets; every gateway process sees them within its plan cache's lifetime."""
    async with sessions() as session, session.begin():
        plan = await session.get(Plan, name, with_for_update=True)
        if plan is None:
            raise not_found("plan", name)
        before = snapshot(plan)
        for field, value in body.model_dump(exclude_unset=True).items():
            setattr(plan, field, value)
        await session.flush()
        record(session, admin, "plan.update", "plan", name, before, snapshot(plan))
    return plan


async def delete_plan(sessions: Sessions, admin: Admin, name: str) -> None:
    """Delete a plan no account is on; a plan in use can only be retired."""
    async with sessions() as session, session.begin():
        plan = await session.get(Plan, name, with_for_update=True)
        if plan is None:
            raise not_found("plan", name)
        on_it = await session.scalar(select(func.count()).where(Account.plan == name))
        if on_it:
            raise APIError(409, f"{on_it} account(s) are on the plan '{name}'; move them first, or retire it "
                           "with PATCH {\"retired\": true}.", code="plan_in_use")
        record(session, admin, "plan.delete", "plan", name, snapshot(plan), None)
        await session.delete(plan)


# -- accounts ----------------------------------------------------------------------------------

async def _plan_exists(session: AsyncSession, name: str) -> None:
    plan = await session.get(Plan, name)
    if plan is None:
        raise APIError(422, f"Unknown plan '{name}'.", param="plan", code="invalid_value")
    if plan.retired:
        raise APIError(422, f"The plan '{name}' is retired.", param="plan", code="plan_retired")


async def create_account(sessions: Sessions, admin: Admin, body: AccountCreate) -> Account:
    async with sessions() as session, session.begin():
        await _plan_exists(session, body.plan)
        if await session.scalar(select(Account).where(Account.name == body.name)) is not None:
            raise APIError(409, f"An account named '{body.name}' exists.", param="name", code="account_exists")
        try:
            account = await ensure_account(session, body.name, body.plan)
        except AccountError as exc:
            raise APIError(422, str(exc), param="plan", code="invalid_value") from exc
        account.daily_limit_override = body.daily_limit_override
        account.unlimited = body.unlimited
        account.dedicated_pool = body.dedicated_pool
        account.max_inflight_override = body.max_inflight_override
        await session.flush()
        await session.refresh(account)
        record(session, admin, "account.create", "account", account.id, None, snapshot(account))
    return account


async def update_account(sessions: Sessions, admin: Admin, account_id: int, body: AccountUpdate) -> Account:
    """Suspend or reactivate, change the plan (a trial's end is set from the moment it starts), set
    enterprise limits or a dedicated pool."""
    async with sessions() as session, session.begin():
        account = await session.get(Account, account_id, with_for_update=True)
        if account is None:
            raise not_found("account", account_id)
        before = snapshot(account)
        changes = body.model_dump(exclude_unset=True)
        plan = changes.pop("plan", None)
        if plan is not None and plan != account.plan:
            await _plan_exists(session, plan)
            await ensure_account(session, account.name, plan)
        for field, value in changes.items():
            setattr(account, field, value)
        await session.flush()
        record(session, admin, "account.update", "account", account_id, before, snapshot(account))
    return account


# -- the model catalog -------------------------------------------------------------------------

def check_tensor_parallel(source: str, options: EngineOptions | None) -> None:
    """For a local model folder, tensor_parallel_size must divide its attention heads."""
    tp = options.tensor_parallel_size if options else None
    config_file = Path(source).expanduser() / "config.json"
    if not tp or tp == 1 or not config_file.is_file():
        return
    config = json.loads(config_file.read_text())
    heads = config.get("num_attention_heads") or config.get("text_config", {}).get("num_attention_heads")
    if heads and heads % tp:
        raise APIError(422, f"tensor_parallel_size {tp} does not divide the model's {heads} attention heads.",
                       param="engine_options.tensor_parallel_size", code="invalid_value")


async def _variants_of(session: AsyncSession, name: str) -> list[str]:
    return list(await session.scalars(select(CatalogModel.name).where(CatalogModel.base_model == name)
                                      .order_by(CatalogModel.name)))


async def _check_variant(session: AsyncSession, model: CatalogModel) -> None:
    """A LoRA variant (``base_model`` set) runs on its base's engines: the base must exist, be enabled,
    be a model of its own and start its engines with enable_lora; the variant keeps nothing up itself.
    400 naming the problem otherwise."""
    base_name = model.base_model
    if base_name is None:
        variants = await _variants_of(session, model.name)
        if variants and (model.engine_options or {}).get("enable_lora") is not True:
            raise APIError(409, f"'{model.name}' is the base of {', '.join(variants)}: its engine options must "
                           "keep enable_lora: true (delete its variants first).",
                           param="engine_options.enable_lora", code="model_has_variants")
        return

    def refuse(message: str, param: str = "base_model") -> APIError:
        return APIError(400, message, param=param, code="invalid_base_model")

    if base_name == model.name:
        raise refuse(f"'{model.name}' cannot be its own base_model.")
    variants = await _variants_of(session, model.name)
    if variants:
        raise refuse(f"'{model.name}' is the base of {', '.join(variants)}, so it cannot be a variant itself.")
    base = await session.get(CatalogModel, base_name)
    if base is None:
        raise refuse(f"The base_model '{base_name}' is not in the catalog; add it first.")
    if base.base_model is not None:
        raise refuse(f"The base_model '{base_name}' is itself a variant of '{base.base_model}': name "
                     f"'{base.base_model}' instead.")
    if not base.enabled:
        raise refuse(f"The base_model '{base_name}' is disabled; enable it first.")
    if (base.engine_options or {}).get("enable_lora") is not True:
        raise refuse(f"The base_model '{base_name}' does not serve adapters: set its engine options' enable_lora "
                     "to true (with max_lora_rank at least this adapter's rank, and max_loras).")
    for field, kept in (("pinned", model.pinned), ("min_workers", model.min_workers),
                        ("idle_timeout_s", model.idle_timeout_s)):
        if kept:
            raise refuse(f"A variant runs on the engines of '{base_name}', which keep it up: set {field} on "
                         f"'{base_name}' instead.", param=field)


async def create_model(sessions: Sessions, admin: Admin, body: ModelCreate) -> CatalogModel:
    if body.base_model is None:
        check_tensor_parallel(body.source, body.engine_options)
    async with sessions() as session, session.begin():
        if await session.get(CatalogModel, body.name) is not None:
            raise APIError(409, f"A model named '{body.name}' exists.", param="name", code="model_exists")
        model = CatalogModel(
            name=body.name, source=body.source, engine_options=body.options(), plans=body.plans,
            pinned=bool(body.pinned), min_workers=body.min_workers or 0, idle_timeout_s=body.idle_timeout_s,
            base_model=body.base_model, enabled=True if body.enabled is None else body.enabled)
        await _check_variant(session, model)
        session.add(model)
        await session.flush()
        await session.refresh(model)
        record(session, admin, "model.create", "model", model.name, None, snapshot(model))
    return model


async def update_model(sessions: Sessions, admin: Admin, name: str, body: ModelUpdate) -> CatalogModel:
    """Apply the fields ``body`` sets. A base model with variants cannot be disabled or lose
    enable_lora (409 naming them): its variants would be left with no engine to run on."""
    async with sessions() as session, session.begin():
        model = await session.get(CatalogModel, name, with_for_update=True)
        if model is None:
            raise not_found("model", name)
        check_tensor_parallel(body.source or model.source, body.engine_options)
        before = snapshot(model)
        changes = body.model_dump(exclude_unset=True)
        changes.pop("trust_remote_code", None)
        if "engine_options" in changes or body.trust_remote_code is not None:
            changes["engine_options"] = body.options(model.engine_options)
        for field, value in changes.items():
            setattr(model, field, value)
        if not model.enabled:
            variants = await _variants_of(session, name)
            if variants:
                raise APIError(409, f"'{name}' is the base of {', '.join(variants)}: disable or delete them first.",
                               param="enabled", code="model_has_variants")
        await _check_variant(session, model)
        await session.flush()
        record(session, admin, "model.update", "model", name, before, snapshot(model))
    return model


async def delete_model(sessions: Sessions, admin: Admin, name: str) -> None:
    """Delete a catalog entry; a base model with variants is refused (409 naming them)."""
    async with sessions() as session, session.begin():
        model = await session.get(CatalogModel, name, with_for_update=True)
        if model is None:
            raise not_found("model", name)
        variants = await _variants_of(session, name)
        if variants:
            raise APIError(409, f"'{name}' is the base of {', '.join(variants)}: delete them first.",
                           code="model_has_variants")
        record(session, admin, "model.delete", "model", name, snapshot(model), None)
        await session.delete(model)
