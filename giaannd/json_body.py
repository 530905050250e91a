"""The JSON object an admin request carries, read one way by every route that takes one (the
compute role's, the membership verbs', the storage topology verbs'): what a body may be and how a
bad one is refused, in one place.

A body is a JSON object whose keys the operation takes; no body is ``{}``. Anything else is a 400
that changed nothing, naming what is wrong: not JSON (bad syntax, an unknown charset, nesting too
deep for the parser), not an object, or a field the operation does not take (a misspelt field
would otherwise be ignored and its default used: ``{"rate": 5}`` ran streams unthrottled), or a
lone surrogate in any string (JSON's ``"\\ud800"``: a prompt carrying one failed as a 500 where its
words were encoded as UTF-8), or a key given twice in one object (JSON parsers keep the last
value silently: ``{"rate_bytes_s": 5, "rate_bytes_s": 500000000}`` ran at the second rate,
whichever the sender meant; RFC 8259 §4 leaves such a document's meaning unpredictable).

The duplicate check (``refuse_duplicate_keys``) runs in the admin API's dispatch, on the body it
has already read, for every operation that takes one: a second parse of a small document (bodies
are under ``admin.max-body-bytes``, 1 MiB), with one Python call per JSON object.
"""

from __future__ import annotations

import json
from typing import Any

from giaannd.errors import AdminHTTPError

__all__ = ["json_object", "refuse_duplicate_keys"]


async def json_object(request: Any, fields: tuple[str, ...], *, null_is_empty: bool = False) -> dict[str, Any]:
    """The request's JSON object (``{}`` without a body; for a JSON ``null`` too with
    ``null_is_empty``), holding only ``fields``.

    Raises:
        AdminHTTPError: 400 ``bad_request`` (module docstring).
    """
    if not getattr(request, "body_exists", True):
        return {}
    try:
        body = await request.json()
    except (ValueError, LookupError, RecursionError):  # LookupError: an unknown charset; nested too deep
        raise AdminHTTPError(400, "request body is not JSON", "bad_request") from None
    if body is None and null_is_empty:
        return {}
    if not isinstance(body, dict):
        raise AdminHTTPError(400, "request body must be a JSON object", "bad_request")
    try:  # a "\\ud800" escape decodes to a lone surrogate, which no UTF-8 step after this can take
        json.dumps(body, ensure_ascii=False, allow_nan=False).encode()
    except UnicodeEncodeError:
        raise AdminHTTPError(400, "request body holds a lone surrogate (a \\uD800-\\uDFFF escape): not text",
                             "bad_request") from None
    except ValueError:  # NaN, Infinity: Python's parser takes them; a number like 1e999 overflows to one
        raise AdminHTTPError(400, "request body holds NaN, Infinity or a number too large: not JSON",
                             "bad_request") from None
    unknown = sorted(set(body) - set(fields))
    if unknown:
        raise AdminHTTPError(400, f"unknown field(s) {', '.join(map(repr, unknown))} in the request body "
                                  f"(it takes {', '.join(fields) or 'none'})", "bad_request")
    return body


def _unique_object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``json.loads``'s ``object_pairs_hook``: the object, refused if it gives a key twice.

    Raises:
        AdminHTTPError: 400 ``bad_request`` naming the key.
    """
    obj = dict(pairs)
    if len(obj) < len(pairs):  # the rare case pays for the search
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise AdminHTTPError(400, f"duplicate key {key!r} in the request body (JSON would keep "
                                          "only its last value)", "bad_request")
            seen.add(key)
    return obj


async def refuse_duplicate_keys(request: Any) -> None:
    """Refuse a body whose JSON gives a key twice in one object (at any depth). A body that does
    not decode passes: ``json_object`` then says what is wrong with it.

    Raises:
        AdminHTTPError: 400 ``bad_request`` naming the key.
    """
    if not getattr(request, "body_exists", True):
        return
    try:
        json.loads(await request.text(), object_pairs_hook=_unique_object)
    except (ValueError, LookupError, RecursionError):  # not JSON: json_object's 400
        return
