"""Rendering console pages: the Jinja2 environment (autoescaped) and the context every page gets."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fastapi import Request
from fastapi.responses import HTMLResponse
from fastapi.templating import Jinja2Templates
from jinja2 import Environment, FileSystemLoader, select_autoescape
from flatfare.gateway.app_state import services_of

HERE = Path(__file__).parent
TEMPLATES_DIR = HERE / "templates"
STATIC_DIR = HERE / "static"


def build_templates() -> Jinja2Templates:
    env = Environment(loader=FileSystemLoader(TEMPLATES_DIR), autoescape=select_autoescape(default=True),
                      trim_blocks=True, lstrip_blocks=True)
    return Jinja2Templates(env=env)


def render(request: Request, name: str, context: dict[str, Any] | None = None, *,
           status_code: int = 200) -> HTMLResponse:
    """Render template ``name`` with ``context`` plus what base.html uses: the session (``console``),
    its CSRF token (``csrf_token``), the settings, the current path and what the member's role opens
    (``areas``, for the nav)."""
    session = getattr(request.state, "console_session", None)
    base = {"console": session, "csrf_token": session.csrf if session else "",
            "settings": services_of(request).settings, "path": request.url.path,
            "areas": getattr(request.state, "console_areas", frozenset())}
    templates: Jinja2Templates = services_of(request).console_templates
    return templates.TemplateResponse(request, name, {**base, **(context or {})}, status_code=status_code)
