"""JSON the proxy reads: a client's request body, read within the guards' limits
(``guards.py``) and parsed only if it is JSON that can be forwarded (no NaN, no infinities), and
the token ids clients and backends send."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import Any

from fastapi.responses import JSONResponse, Response
from starlette.requests import ClientDisconnect, Request

from connector.proxy.errors import RequestRefused, openai_error
from connector.proxy.guards import BodyHold, LimitExceeded, NotUtf8, RequestGuards

# the answer to a request over one of the guards' limits, counted in /metrics (``app.py``)
Refusal = Callable[[LimitExceeded], JSONResponse]


def refuse_constant(name: str) -> Any:
    """``parse_constant`` for ``json.loads``: NaN and +-Infinity are not JSON."""
    raise ValueError(f"{name} is not a JSON number")


def finite_float(text: str) -> float:
    """``parse_float`` for ``json.loads``: a number JSON can carry on."""
    value = float(text)
    if not math.isfinite(value):  # 1e400: Python reads it as inf, which JSON cannot carry
        raise ValueError(f"number {text[:40]} is out of range")
    return value


async def read_json(
    request: Request, hold: BodyHold, guards: RequestGuards, refusal: Refusal
) -> Any:
    """The body as JSON, read no further than ``max_body_bytes`` (a bigger one is refused
    by its Content-Length, or, chunked, as soon as what came exceeds the limit), its bytes
    held in ``hold``, and parsed only within the guards' limits (``guards.py``).
    Raises :class:`RequestRefused`."""
    try:
        text = await guards.read_json_text(request, hold)
    except LimitExceeded as exceeded:
        raise RequestRefused(refusal(exceeded)) from None
    except NotUtf8 as exc:
        raise RequestRefused(openai_error(400, str(exc), "invalid_request_error")) from None
    except ClientDisconnect:
        raise RequestRefused(Response(status_code=499)) from None
    try:
        # NaN and +-Infinity are not JSON: refused here, they could not be forwarded
        return json.loads(text, parse_constant=refuse_constant, parse_float=finite_float)
    except RecursionError:
        message = "request body is nested too deeply"
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, a non-finite number
        message = f"request body is not valid JSON: {exc}"
    raise RequestRefused(openai_error(400, message, "invalid_request_error"))
