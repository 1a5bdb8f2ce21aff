"""The model catalog's admin writes (the admin API's routes and the admin console call these), through the
admin services' audited write (:func:`flatfare.gateway.admin.services.audited`): a LoRA variant is
checked against its base, a base keeps what its variants need, a local model's tensor parallelism
divides its attention heads."""

from __future__ import annotations

import json
from pathlib import Path

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from flatfare.storage.models import CatalogModel
from flatfare.gateway.admin.auth import Admin
from flatfare.gateway.admin.catalog_schemas import ModelCreate, ModelUpdate
from flatfare.gateway.admin.model_options import EngineOptions
from flatfare.gateway.admin.services import Sessions, audited, created, writing
from flatfare.gateway.errors import APIError


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
    async with writing(sessions, admin) as session:
        if await session.get(CatalogModel, body.name) is not None:
            raise APIError(409, f"A model named '{body.name}' exists.", param="name", code="model_exists")
        model = CatalogModel(
            name=body.name, source=body.source, engine_options=body.options(), plans=body.plans,
            pinned=bool(body.pinned), min_workers=body.min_workers or 0, idle_timeout_s=body.idle_timeout_s,
            base_model=body.base_model, enabled=True if body.enabled is None else body.enabled)
        await _check_variant(session, model)
        session.add(model)
        await created(session, admin, "model.create", "model", model, model.name)
    return model


async def update_model(sessions: Sessions, admin: Admin, name: str, body: ModelUpdate) -> CatalogModel:
    """Apply the fields ``body`` sets. A base model with variants cannot be disabled or lose
    enable_lora (409 naming them): its variants would be left with no engine to run on."""
    async with audited(sessions, admin, "model.update", "model", CatalogModel, name) as change:
        model, session = change.row, change.session
        check_tensor_parallel(body.source or model.source, body.engine_options)
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
    return model


async def delete_model(sessions: Sessions, admin: Admin, name: str) -> None:
    """Delete a catalog entry; a base model with variants is refused (409 naming them)."""
    async with audited(sessions, admin, "model.delete", "model", CatalogModel, name) as change:
        variants = await _variants_of(change.session, name)
        if variants:
            raise APIError(409, f"'{name}' is the base of {', '.join(variants)}: delete them first.",
                           code="model_has_variants")
        change.deleted = True
