"""The admin API under ``/admin/v1``: plans, models, accounts, keys, usage, audit, admin tokens, fleets."""

from fastapi import APIRouter

from flatfare.gateway.admin import accounts, catalog, fleets, quota_alerts, reports
from flatfare.gateway.errors import ERROR_RESPONSES

router = APIRouter(prefix="/admin/v1", tags=["admin"], responses=ERROR_RESPONSES)
router.include_router(catalog.router)
router.include_router(accounts.router)
router.include_router(quota_alerts.router)
router.include_router(reports.router)
router.include_router(fleets.router)
