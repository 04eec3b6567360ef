"""``GET /``: the chat page (``static/chat.html``, with its ``chat.js`` and ``chat.css``).

The page is a client like any other: it streams ``/v1/chat/completions`` over SSE and reads
``/metrics``, sending the API key the user types when the server asks for one. Its files are read
once, at import, and served from memory.

The page holds an API key and shows the model's text, so it is sent with the headers that keep
other sites out of it: a Content-Security-Policy of ``default-src 'self'`` (scripts, styles and
fetches from this server only; no inline code - hence the script and the style are files of their
own - so text that ever slipped into the DOM as HTML could not run), ``frame-ancestors 'none'`` and
``X-Frame-Options: DENY`` (no site may frame it to trick clicks; the second for older browsers),
and ``X-Content-Type-Options: nosniff`` (each file is only what its Content-Type says).
"""
from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import Response
from starlette.exceptions import HTTPException

PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'self'",
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
}
MEDIA_TYPES = {"chat.html": "text/html; charset=utf-8", "chat.js": "text/javascript; charset=utf-8",
               "chat.css": "text/css; charset=utf-8"}
FILES = {name: (Path(__file__).parent / "static" / name).read_bytes() for name in MEDIA_TYPES}

router = APIRouter()


def page_file(name: str) -> Response:
    return Response(FILES[name], media_type=MEDIA_TYPES[name], headers=PAGE_HEADERS)


@router.get("/", include_in_schema=False)
async def chat_page() -> Response:
    return page_file("chat.html")


@router.get("/static/{name}", include_in_schema=False)
async def static_file(name: str) -> Response:
    if name not in FILES:  # only the page's own files: no directory is served
        raise HTTPException(404)
    return page_file(name)
