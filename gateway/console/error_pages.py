"""Console-styled error pages. A browser that opens a console page (or a Checkout return page) and is
refused, whatever the reason (a mistyped address, ``/console/logout`` typed in, a tab posting after its
session ended, a stale form, a body too large, too many attempts, a failure of ours), gets an HTML page
in the console's look with a way back, with the refusal's own status. Everything else keeps OpenAI's
JSON error body: the API (``/v1``, the admin API), htmx requests (htmx reads the status and headers)
and the Playground's fetch, none of which asks for HTML.

:func:`install` wraps the app's JSON handlers (:func:`flatfare.gateway.errors.install_handlers`); it
decides per request, so an API answer is byte for byte what it was."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from redis.exceptions import RedisError
from sqlalchemy.exc import SQLAlchemyError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from flatfare.gateway.console.headers import is_console_path
from flatfare.gateway.console.pages import render
from flatfare.gateway.errors import APIError, error_body

log = logging.getLogger("flatfare.console")

Handler = Callable[[Request, Exception], Awaitable[Response]]

# The page's heading for each status, and what routing's own terse details ("Not Found") become.
TITLES = {400: "That request could not be used", 401: "Your session has ended", 403: "Not allowed",
          404: "Page not found", 405: "This address opens no page", 413: "Too large",
          415: "That request could not be used", 422: "That request could not be used",
          429: "Too many requests", 500: "Something went wrong on our side",
          503: "Temporarily unavailable"}
ROUTING_MESSAGES = {
    404: "There is no console page at this address. Check the link, or go back to the console.",
    405: "This address is the target of a button (logging out, revoking a key, ...), not a page to open. "
         "Use the button in the console instead.",
}
SESSION_ENDED = "Your console session has ended (you logged out, or it expired). Log in again to continue."
SERVER_FAILED = "The console could not finish this request. Nothing you did caused it; try again in a moment."


def wants_page(request: Request) -> bool:
    """A browser's navigation or plain form post to a console page: it asked for HTML, not through htmx."""
    path = request.url.path
    return (is_console_path(path) and not path.startswith("/console/static/")
            and "hx-request" not in request.headers and "text/html" in request.headers.get("accept", ""))


def error_page(request: Request, status: int, message: str, headers: dict[str, str] | None = None) -> Response:
    title = TITLES.get(status, "Something went wrong on our side" if status >= 500 else "That did not work")
    response = render(request, "error.html", {"status": status, "title": title, "message": message},
                      status_code=status)
    response.headers.update(headers or {})
    return response


def install(app: FastAPI) -> None:
    """Put the console's pages in front of the JSON handlers already installed (and answer an
    unexpected exception with a page, or with OpenAI's 500 body, instead of a bare text line)."""

    def paged(json_handler: Handler, page_of: Callable[[Exception], tuple[int, str, dict[str, str]]]) -> Handler:
        async def handler(request: Request, exc: Exception) -> Response:
            if wants_page(request):
                return error_page(request, *page_of(exc))
            return await json_handler(request, exc)
        return handler

    def api_error(exc: Exception) -> tuple[int, str, dict[str, str]]:
        assert isinstance(exc, APIError)
        return exc.status, exc.message, exc.headers

    def http_error(exc: Exception) -> tuple[int, str, dict[str, str]]:
        assert isinstance(exc, StarletteHTTPException)
        return exc.status_code, ROUTING_MESSAGES.get(exc.status_code, str(exc.detail)), dict(exc.headers or {})

    def bad_form(_: Exception) -> tuple[int, str, dict[str, str]]:
        return 400, "A field of that form could not be read. Go back, check it and try again.", {}

    def unavailable(_: Exception) -> tuple[int, str, dict[str, str]]:
        return 503, "The console cannot reach its storage right now. Try again in a moment.", {"Retry-After": "1"}

    for exc_class, page_of in ((APIError, api_error), (StarletteHTTPException, http_error),
                               (RequestValidationError, bad_form), (RedisError, unavailable),
                               (SQLAlchemyError, unavailable)):
        app.add_exception_handler(exc_class, paged(app.exception_handlers[exc_class], page_of))

    @app.exception_handler(Exception)
    async def _server_error(request: Request, exc: Exception) -> Response:
        # Starlette logs the exception itself after this answer; only the answer is chosen here.
        if wants_page(request):
            return error_page(request, 500, SERVER_FAILED)
        return JSONResponse(error_body(500, "The server failed to handle the request; retry, and report it if it "
                                       "persists.", code="internal_error"), status_code=500)
