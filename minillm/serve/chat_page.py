"""``GET /``: the chat page, one HTML file with its JavaScript and CSS inside (``static/chat.html``).

The page is a client like any other: it streams ``/v1/chat/completions`` over SSE and reads
``/metrics``, sending the API key the user types when the server asks for one. It is read once, at
import, and served from memory.
"""
from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import HTMLResponse

CHAT_HTML = (Path(__file__).parent / "static" / "chat.html").read_text(encoding="utf-8")

router = APIRouter()


@router.get("/", response_class=HTMLResponse, include_in_schema=False)
async def chat_page() -> HTMLResponse:
    return HTMLResponse(CHAT_HTML)
