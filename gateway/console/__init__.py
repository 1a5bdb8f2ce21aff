"""The web console: server-rendered pages (Jinja2 and htmx) for customers and admins, at ``/console``.

:func:`install` mounts it on the gateway's FastAPI app; the lifespan calls :func:`start` once Redis is
open. Routes use the dependencies of :mod:`.deps` (``ConsoleCustomer``, ``ConsoleAdmin``, ``ConsoleForm``).
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, RedirectResponse, Response
from fastapi.staticfiles import StaticFiles
from redis.asyncio import Redis

from flatfare.gateway.errors import error_body
from flatfare.gateway.console import (account, admin, alerts, auth, billing, error_pages, keys, playground, quickstart,
                                      signup, team, usage_pages)
from flatfare.gateway.console.deps import LoginRequired
from flatfare.gateway.console.headers import ConsoleHeaders
from flatfare.gateway.console.pages import STATIC_DIR
from flatfare.gateway.console.sessions import ConsoleSessions
from flatfare.gateway.settings import GatewaySettings

__all__ = ["install", "sessions"]


def install(app: FastAPI, settings: GatewaySettings) -> None:
    """Add the console's routes, static files, headers and login redirect to ``app``."""
    if not settings.console_enabled:
        return
    app.mount("/console/static", StaticFiles(directory=STATIC_DIR), name="console-static")
    app.include_router(auth.router)
    for module in (account, signup, keys, quickstart, playground, usage_pages, alerts, billing, team):
        app.include_router(module.router)
    app.include_router(admin.router)
    app.add_middleware(ConsoleHeaders)
    error_pages.install(app)

    @app.exception_handler(LoginRequired)
    async def _login_required(request: Request, exc: LoginRequired) -> Response:
        target = "/console/login?admin=1" if exc.admin else "/console/login"
        if request.method == "GET" and "hx-request" not in request.headers:
            return RedirectResponse(target, status_code=303)
        if error_pages.wants_page(request):  # a tab's form posted after its session ended
            return error_pages.error_page(request, 401, error_pages.SESSION_ENDED)
        body = error_body(401, "Log in to the console first.", code="login_required")
        return JSONResponse(body, status_code=401, headers={"HX-Redirect": target})


def sessions(settings: GatewaySettings, redis: Redis) -> ConsoleSessions:
    """The console's sessions (the app's ``services.console_sessions``), made by the lifespan once Redis is open."""
    return ConsoleSessions(redis, idle_s=settings.console_session_idle_s, secure=not settings.local_mode)
