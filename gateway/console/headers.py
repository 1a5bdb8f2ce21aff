"""Security headers on every console page: a CSP without inline scripts or styles, no framing, no
MIME sniffing, no referrer (reset links carry a token in their URL), and no caching of pages."""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

# The paths the console serves (C2's Checkout return pages included).
CONSOLE_PATHS = ("/console", "/billing/success", "/billing/cancel")

CSP = ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; font-src 'self'; "
       "connect-src 'self'; object-src 'none'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'")

_HEADERS = [
    (b"content-security-policy", CSP.encode()),
    (b"x-content-type-options", b"nosniff"),
    (b"x-frame-options", b"DENY"),
    (b"referrer-policy", b"no-referrer"),
    (b"cross-origin-opener-policy", b"same-origin"),
    (b"permissions-policy", b"camera=(), microphone=(), geolocation=()"),
]
_NO_STORE = (b"cache-control", b"no-store")


def is_console_path(path: str) -> bool:
    return any(path == p or path.startswith(p + "/") for p in CONSOLE_PATHS)


class ConsoleHeaders:
    """ASGI middleware: adds the headers above to every response under :data:`CONSOLE_PATHS`."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not is_console_path(scope["path"]):
            await self.app(scope, receive, send)
            return
        static = scope["path"].startswith("/console/static/")

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                present = {name.lower() for name, _ in message.get("headers", [])}
                extra = [h for h in _HEADERS if h[0] not in present]
                if not static and b"cache-control" not in present:
                    extra.append(_NO_STORE)
                message = {**message, "headers": [*message.get("headers", []), *extra]}
            await send(message)

        await self.app(scope, receive, send_with_headers)
