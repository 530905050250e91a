"""giaannd/json_body.py: the JSON object of an admin request, refused with a 400 naming what is wrong."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from giaannd.errors import AdminHTTPError
from giaannd.json_body import json_object


class _Request:
    """What json_object reads of an aiohttp request: ``body_exists`` and ``json()``."""

    def __init__(self, text: str | None) -> None:
        self.body_exists = text is not None
        self._text = text

    async def json(self) -> Any:
        assert self._text is not None
        return json.loads(self._text)


def _read(text: str | None, fields: tuple[str, ...] = ("prompt",), **kw: Any) -> dict[str, Any]:
    return asyncio.run(json_object(_Request(text), fields, **kw))


def test_a_body_is_an_object_of_the_fields_the_operation_takes() -> None:
    assert _read(None) == {}
    assert _read('{"prompt": "In the beginning"}') == {"prompt": "In the beginning"}
    assert _read("null", null_is_empty=True) == {}


@pytest.mark.parametrize(("text", "why"), [
    ("{", "not JSON"),
    ("[1]", "JSON object"),
    ("null", "JSON object"),
    ('{"prompt": "x", "promt": "y"}', "unknown field"),
    ('{"prompt": "\\ud800 god"}', "lone surrogate"),
    ('{"prompt": ["In", "the", "\\udfff"]}', "lone surrogate"),
])
def test_a_bad_body_is_a_400_naming_what_is_wrong(text: str, why: str) -> None:
    """(The lone surrogate, a JSON escape no UTF-8 step can encode, was let through: a generate
    prompt carrying one failed as a 500 where its words were encoded.)"""
    with pytest.raises(AdminHTTPError, match=why) as info:
        _read(text)
    assert info.value.status == 400
