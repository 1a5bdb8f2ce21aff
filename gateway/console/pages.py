"""Rendering console pages: the Jinja2 environment (autoescaped) and the context every page gets."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fastapi import Request
from fastapi.responses import HTMLResponse
from fastapi.templating import Jinja2Templates
from jinja2 import Environment, FileSystemLoader, select_autoescape

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
    its CSRF token (``csrf_token``), the settings and the current path (for the nav)."""
    session = getattr(request.state, "console_session", None)
    base = {"console": session, "csrf_token": session.csrf if session else "",
            "settings": request.app.state.settings, "path": request.url.path}
    templates: Jinja2Templates = request.app.state.console_templates
    return templates.TemplateResponse(request, name, {**base, **(context or {})}, status_code=status_code)
