"""The proxy's error answers: OpenAI-style JSON (``{"error": {...}}``) for every failure, its
own or a backend's, and the exceptions that carry such an answer up to the route."""

from __future__ import annotations

import http
import json

from fastapi.responses import JSONResponse, Response


def openai_error(status: int, message: str, type_: str, param: str | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": type_, "param": param, "code": status}}
    return JSONResponse(body, status_code=status)


class BackendError(Exception):
    """A backend failed or refused: ``response`` is what the client gets instead."""

    def __init__(self, response: Response) -> None:
        super().__init__("backend error")
        self.response = response


class RequestRefused(Exception):
    """The request is answered with ``response`` before it goes anywhere (too big, bad JSON)."""

    def __init__(self, response: Response) -> None:
        super().__init__("request refused")
        self.response = response


def passthrough_error(status: int, content: bytes, role: str, url: str) -> Response:
    """The backend's own OpenAI error when it sent one, else a wrapped one; same status (a
    status that is not an error, a redirect say, is no answer: 502; nor one HTTP does not
    define, 499 or 520 say: uvicorn has no status line for it and cut the client's
    connection, so it is answered 502 with the backend's words)."""
    if status < 400:
        return openai_error(502, f"{role} server {url} answered {status}", "backend_error")
    defined = status in _ERROR_STATUSES
    try:
        doc = json.loads(content)
        if isinstance(doc, dict) and ("error" in doc or "message" in doc or "detail" in doc):
            return JSONResponse(doc, status_code=status if defined else 502)
    except (ValueError, RecursionError):  # not JSON (JSONDecodeError, UnicodeDecodeError)
        pass
    text = content[:500].decode(errors="replace")
    return openai_error(
        status if defined else 502,
        f"{role} server {url} answered {status}: {text}",
        "backend_error",
    )


# the error statuses HTTP defines (and uvicorn has status lines for)
_ERROR_STATUSES = frozenset(s.value for s in http.HTTPStatus if 400 <= s.value < 600)
