"""gateway/app.py: what the lifespan does to the process besides opening its clients."""

from __future__ import annotations

import gc
from pathlib import Path

from flatfare.gateway.app import GC_THRESHOLDS
from tests.gateway.rig import in_process_gateway


async def test_the_lifespan_freezes_the_start_and_collects_young_objects_less_often(redis_url: str,
                                                                                 tmp_path: Path) -> None:
    defaults = gc.get_threshold()
    gc.unfreeze()
    gc.set_threshold(700, 10, 10)
    try:
        async with in_process_gateway(redis_url, tmp_path):
            assert gc.get_threshold() == GC_THRESHOLDS
            assert gc.get_freeze_count() > 0  # the heap the start built is never walked again
    finally:
        gc.set_threshold(*defaults)
