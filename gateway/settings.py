"""The gateway process's settings."""

from __future__ import annotations

from flatfare.settings import CommonSettings


class GatewaySettings(CommonSettings):
    host: str = "127.0.0.1"
    port: int = 8000
    # Largest request body accepted, in bytes (plans may lower it); larger ones get 413.
    max_body_bytes: int = 8 * 1024 * 1024
    # How long a request may wait for its worker's answer, queued and running together.
    request_timeout_s: float = 600.0
    # How long an authenticated key, the catalog and the live-worker view are reused in-process.
    auth_cache_ttl_s: float = 0.5
    pools_cache_ttl_s: float = 0.5
    plans_cache_ttl_s: float = 0.5
    db_pool_size: int = 20
