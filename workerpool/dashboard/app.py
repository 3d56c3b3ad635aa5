"""The dashboard's ASGI app: read-only pages over the fleet, each with a live part its page
polls (``?fragment=1``), and the dead letters' actions, each a POST behind a confirmation page
and a CSRF token."""

from __future__ import annotations

import contextlib
import hmac
import logging
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any

from google.api_core import exceptions as gexc
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import FormData
from starlette.requests import Request
from starlette.responses import HTMLResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.templating import Jinja2Templates

from workerpool.config import Settings
from workerpool.dashboard import csrf
from workerpool.dashboard.chart import minutes_chart
from workerpool.dashboard.control import Order, carry_out, order
from workerpool.dashboard.letters import ACTIONS, DeadLetters, Selection
from workerpool.dashboard.reading import LIMIT, Fleet
from workerpool.dashboard.stores import Openers
from workerpool.dashboard.templating import environment
from workerpool.errors import ConfigError
from workerpool.periodic import Marks
from workerpool.pubsub import Clients, connect, subscription_path
from workerpool.stores import StoreError

log = logging.getLogger(__name__)

# Each read page: its title and what its template gets (read in a worker thread).
PAGES: dict[str, tuple[str, Callable[[Fleet], dict[str, Any]]]] = {
    "overview": ("Overview", lambda f: {"replicas": f.replicas(), "backlog": f.backlog()}),
    "running": ("Running", lambda f: f.running()),
    "keys": ("Keys", lambda f: {"keys": f.keys(), "limit": LIMIT}),
    "batches": ("Batches", lambda f: {"batches": f.batches()}),
    "schedules": ("Schedules", lambda f: {"delayed": f.delayed(), "periodic": f.periodic()}),
    "autoscaler": ("Autoscaler", lambda f: {"decisions": f.decisions()}),
}
# What a page shows instead when a store or Pub/Sub cannot be read: why, in one line.
_UNREADABLE = (StoreError, gexc.GoogleAPICallError, ConfigError)  # (no credentials found)


class Dashboard:
    """The app's endpoints over one fleet, its dead-letter subscription and its token."""

    def __init__(
        self,
        fleet: Fleet,
        clients: Clients | None,
        dead_letters: str,
        token: str,
        marks: Callable[[], Marks] | None = None,
    ) -> None:
        self.fleet = fleet
        self._token = token  # "": read-only, every action refused
        self._clients = clients
        self._connecting = threading.Lock()  # endpoints run on several threads
        self.dead_letters = dead_letters  # the dead-letter subscription's path, or ""
        self._letters = DeadLetters(dead_letters, lambda: self.clients) if dead_letters else None
        self._marks = marks  # opens the periodic schedules' marks (None: none kept)
        self.templates = Jinja2Templates(env=environment(), context_processors=[self._context])

    @property
    def clients(self) -> Clients:
        with self._connecting:
            if self._clients is None:
                self._clients = connect()
            return self._clients

    def warm(self) -> None:
        """Start reading the dead letters for their page's index: a first view then waits
        only for what is left of the read."""
        if self._letters is not None:
            self._letters.index.warm()

    def close(self) -> None:
        if self._letters is not None and not self._letters.index.settle(30):
            log.warning("dashboard: stopping while reading the dead letters: held ones come back "
                        "at their ack deadline")  # fmt: skip
        if self._clients is not None:
            self._clients.close()

    def _context(self, request: Request) -> dict[str, Any]:
        return {
            "pages": PAGES,
            "letters_page": bool(self.dead_letters),
            "actions": bool(self._token),
        }

    def render(self, request: Request, name: str, context: dict[str, Any]) -> Response:
        token = csrf.token(request)
        response = self.templates.TemplateResponse(
            request, name, {**context, "csrf_field": csrf.FIELD, "csrf_token": token}
        )
        csrf.remember(response, token)
        return response

    async def page(self, request: Request) -> Response:
        name = request.path_params.get("page", "overview")
        if name not in PAGES:
            return HTMLResponse("no such page", status_code=404)
        title, read = PAGES[name]
        context = await _read(lambda: read(self.fleet))
        if request.query_params.get("fragment"):
            return self.render(request, f"{name}_live.html", context)
        return self.render(request, "page.html", {**context, "page": name, "title": title})

    async def chart(self, request: Request) -> Response:
        """The chart of jobs done and runs failed per minute, as an SVG image: shown by an
        <img>, in which a browser runs no script (pygal writes its config as one)."""
        counts = await run_in_threadpool(self.fleet.per_minute)
        return Response(minutes_chart(counts), media_type="image/svg+xml")

    async def letters(self, request: Request) -> Response:
        selection = Selection.of(request.query_params, [])
        after = request.query_params.get("after", "")
        context: dict[str, Any] = {"page_of": None}
        if (index := self._letters) is not None:  # else the page says where to read them
            context = await _read(lambda: {"page_of": index.page(selection, LIMIT, after)})
        return self.render(
            request,
            "letters.html",
            {**context, "selection": selection, "title": "Dead letters"},
        )

    async def confirm(self, request: Request) -> Response:
        """The confirmation page of an action asked for on the Dead letters page."""
        found = await self._action(request, confirmed=False)
        if isinstance(found, Response):
            return found
        action, selection = found
        return self.render(
            request,
            "confirm.html",
            {"action": action, "selection": selection, "title": f"Confirm: {action}"},
        )

    async def apply(self, request: Request) -> Response:
        """An action confirmed: carried out, with an audit line of who asked."""
        found = await self._action(request, confirmed=True)
        if isinstance(found, Response) or self._letters is None:
            return found if isinstance(found, Response) else HTMLResponse("no dead letters", 404)
        action, selection = found
        who = _who(request)
        counts = await run_in_threadpool(self._letters.apply, action, selection)
        log.warning(
            "dashboard: %s of %s on %s by %s: %s", action, selection.describe(),
            self.dead_letters, who, dict(counts) or "nothing matched",
        )  # fmt: skip
        return self.render(
            request,
            "applied.html",
            {"action": action, "selection": selection, "counts": counts, "title": "Done"},
        )

    async def _action(
        self, request: Request, *, confirmed: bool
    ) -> tuple[str, Selection] | Response:
        """The action and selection a POST asks for, or the response refusing it: without a
        token configured, with a wrong CSRF token, and (``confirmed``: the action itself)
        without the confirmation and the dashboard's token."""
        form = await self._form(request, confirmed=confirmed)
        if isinstance(form, Response):
            return form
        one = str(form.get("one", ""))
        action = "replay" if one else str(form.get("action", ""))
        if action not in ACTIONS:
            return HTMLResponse(f"unknown action {action!r}", status_code=400)
        selected = one or form.get("scope") == "selected"
        ids = [one] if one else [str(i) for i in form.getlist("id")] if selected else []
        if selected and not ids:
            return HTMLResponse("nothing selected", status_code=400)
        return action, Selection.of(form, ids)

    async def _form(self, request: Request, *, confirmed: bool) -> FormData | Response:
        """The form of an action's POST, or the response refusing it: without a token
        configured, with a wrong CSRF token, and (``confirmed``: the action itself) without
        the confirmation and the dashboard's token."""
        if not self._token:
            return HTMLResponse("refused: read-only (no --token configured)", status_code=403)
        form = await request.form()
        if not csrf.allowed(request, str(form.get(csrf.FIELD, ""))):
            return HTMLResponse("refused: missing or wrong CSRF token", status_code=403)
        if confirmed and form.get("confirmed") != "yes":
            return HTMLResponse("refused: not confirmed", status_code=400)
        sent = str(form.get("token", "")).encode()
        if confirmed and not hmac.compare_digest(sent, self._token.encode()):
            return HTMLResponse("refused: wrong token", status_code=403)
        return form

    async def control_confirm(self, request: Request) -> Response:
        """The confirmation page of an action asked for on the Running or Schedules page."""
        found = await self._order(request, confirmed=False)
        if isinstance(found, Response):
            return found
        return self.render(
            request, "control_confirm.html", {"order": found, "title": f"Confirm: {found.action}"}
        )

    async def control_apply(self, request: Request) -> Response:
        """A Running or Schedules action confirmed: carried out, with an audit line."""
        found = await self._order(request, confirmed=True)
        if isinstance(found, Response):
            return found
        who = _who(request)
        fleet = self.fleet
        lines = await run_in_threadpool(
            carry_out, fleet.settings, fleet.schedules, self._marks, found, who
        )
        log.warning("dashboard: %s of %s by %s: %s", found.action, found.describe(), who,
                    "; ".join(lines))  # fmt: skip
        return self.render(
            request, "control_applied.html", {"order": found, "lines": lines, "title": "Done"}
        )

    async def _order(self, request: Request, *, confirmed: bool) -> Order | Response:
        form = await self._form(request, confirmed=confirmed)
        if isinstance(form, Response):
            return form
        one = str(form.get("one", ""))
        targets = [one] if one else [str(i) for i in form.getlist("id")]
        found = order(str(form.get("page", "")), str(form.get("action", "")), targets)
        return HTMLResponse(found, status_code=400) if isinstance(found, str) else found


def _who(request: Request) -> str:
    """Who asked for an action, for its audit line: the client's address, and the user the
    IAP header names, if any. The header is a claim any client can make where no IAP stands
    in front: the address the request came from is always said beside it."""
    address = request.client.host if request.client else "unknown"
    user = request.headers.get("x-goog-authenticated-user-email")
    return f"{user} (IAP header) at {address}" if user else address


async def _read(read: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """``read()`` in a worker thread (stores and Pub/Sub block); what went wrong, if it did."""
    try:
        return await run_in_threadpool(read)
    except _UNREADABLE as exc:
        return {"error": f"cannot read: {exc}"}


def create_app(
    settings: Settings,
    *,
    dead_letter_subscription: str = "",
    token: str = "",
    openers: Openers | None = None,
    clients: Clients | None = None,
) -> Starlette:
    """The dashboard of the fleet ``settings`` describe (its stores beside
    ``settings.idempotency_store``), as an ASGI app to serve or mount. The dead letters are
    read from ``dead_letter_subscription`` (default: ``settings.dead_letter_topic`` + "-sub",
    as ``workerpool provision`` names it); Pub/Sub ``clients`` are made on first use. Without
    a ``token`` the dashboard is read-only; with one, an action is carried out only once
    confirmed with it."""
    openers = openers or Openers.of(settings.idempotency_store)
    fleet = Fleet(settings, openers)
    letters_sub = dead_letter_subscription or (
        f"{settings.dead_letter_topic}-sub" if settings.dead_letter_topic else ""
    )
    dashboard = Dashboard(
        fleet,
        clients,
        subscription_path(settings.project, letters_sub) if letters_sub else "",
        token,
        openers.marks,
    )

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        dashboard.warm()
        yield
        dashboard.close()

    routes = [
        Route("/", dashboard.page, name="overview"),
        Route("/chart/jobs.svg", dashboard.chart, name="chart"),
        Route("/dead-letters", dashboard.letters, name="letters"),
        Route("/dead-letters/confirm", dashboard.confirm, methods=["POST"], name="confirm"),
        Route("/dead-letters/apply", dashboard.apply, methods=["POST"], name="apply"),
        Route(
            "/control/confirm", dashboard.control_confirm, methods=["POST"], name="control_confirm"
        ),
        Route("/control/apply", dashboard.control_apply, methods=["POST"], name="control_apply"),
        Route("/{page}", dashboard.page, name="page"),
        Mount("/static", StaticFiles(packages=[("workerpool.dashboard", "static")]), name="static"),
    ]
    return Starlette(routes=routes, lifespan=lifespan)
