"""Cross-site request forgery: every action is a POST carrying the token its form was given
(a double-submit cookie: another site can make a browser send the cookie, but cannot read it
to put in the form), and, when the browser says where the request comes from, from this
dashboard's own origin."""

from __future__ import annotations

import hmac
import secrets
from urllib.parse import urlsplit

from starlette.requests import Request
from starlette.responses import Response

COOKIE = "workerpool_csrf"
FIELD = "csrf_token"


def token(request: Request) -> str:
    """The browser's token, or a new one (``remember`` sets it on the response)."""
    return request.cookies.get(COOKIE) or secrets.token_urlsafe(32)


def remember(response: Response, value: str) -> None:
    response.set_cookie(COOKIE, value, httponly=True, samesite="strict")


def allowed(request: Request, sent: str) -> bool:
    """The form's token matches the cookie, and the request comes from this origin."""
    kept = request.cookies.get(COOKIE, "")
    if not kept or not hmac.compare_digest(kept.encode(), sent.encode()):  # str: ASCII only
        return False
    origin = request.headers.get("origin")
    return origin is None or urlsplit(origin).netloc == request.headers.get("host", "")
