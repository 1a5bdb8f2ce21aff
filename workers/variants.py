"""LoRA variants of a worker's model: catalog entries whose ``base_model`` is that model.

Their ``source`` is the adapter (a folder, or a hub id), resolved like a model's. The base model's
workers load every enabled variant at start and, when a request names one they have not loaded (added
to the catalog since), look it up here and load it then.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from sqlalchemy import select
from sqlalchemy.exc import SQLAlchemyError

from flatfare.storage.db import one_session
from flatfare.storage.models import CatalogModel
from flatfare.workers.prepare import resolve_source


class Variants:
    def __init__(self, database_url: str, base_model: str, models_dir: Path) -> None:
        self.database_url = database_url
        self.base_model = base_model
        self.models_dir = models_dir

    async def _sources(self, name: str | None = None) -> dict[str, str]:
        query = select(CatalogModel.name, CatalogModel.source).where(
            CatalogModel.base_model == self.base_model, CatalogModel.enabled.is_(True))
        if name is not None:
            query = query.where(CatalogModel.name == name)
        async with one_session(self.database_url) as session:
            rows = (await session.execute(query)).all()
        return {row.name: row.source for row in rows}

    async def all(self) -> dict[str, str]:
        """Every enabled variant of the base model: name -> adapter (a folder or hub id)."""
        sources = await self._sources()
        return {name: await asyncio.to_thread(resolve_source, source, self.models_dir)
                for name, source in sources.items()}

    async def adapter(self, name: str) -> str | None:
        """The adapter of the variant ``name``; None if the catalog has no enabled variant of that name
        on this base model (or cannot be read: the request then fails as for an unknown model)."""
        try:
            sources = await self._sources(name)
        except SQLAlchemyError:
            return None
        source = sources.get(name)
        return None if source is None else await asyncio.to_thread(resolve_source, source, self.models_dir)
