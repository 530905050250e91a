"""An admin request body with a key given twice is a 400 naming the key: JSON parsers keep the
last value silently, so ``{"rate_bytes_s": 5, "rate_bytes_s": 500000000}`` ran on whichever the
sender did not mean, where a mature API refuses the ambiguity (RFC 8259 §4: names SHOULD be
unique; behaviour otherwise is unpredictable)."""

from __future__ import annotations

from pathlib import Path

import pytest

from giaannd.admin import ctl
from tests.unit.admin.test_health import _answer, _api_with_roles, _post
from tests.unit.sdk.fake_api import serving


@pytest.mark.asyncio
@pytest.mark.parametrize(("path", "body", "key"), [
    ("/v1/node/topology/rate", b'{"rate_bytes_s": 5, "rate_bytes_s": 7}', "rate_bytes_s"),
    ("/v1/node/join", b'{"seeds": ["127.0.0.1:7000"], "seeds": ["127.0.0.1:7001"]}', "seeds"),
    ("/v1/generate", b'{"prompt": "the cat", "constants": {"k": 1, "k": 2}}', "k"),  # nested too
    ("/v1/train", b'{"corpus": "a.conllu", "corpus": "b.conllu"}', "corpus"),
])
async def test_admin_body_with_a_duplicate_key_is_a_400_naming_it(path: str, body: bytes, key: str,
                                                                  tmp_path: Path) -> None:
    """(The rate route set the streams' throttle to the last value, 7: 200.)"""
    api, op, node, _ = _api_with_roles(tmp_path)
    status, doc = await _answer(api, _post(path, body))
    assert (status, doc["code"]) == (400, "bad_request"), doc
    assert f"duplicate key {key!r}" in doc["error"], doc
    assert op.rates == [] and node.joins == []  # nothing was done


@pytest.mark.asyncio
async def test_admin_body_with_distinct_keys_still_passes(tmp_path: Path) -> None:
    """The same key in two different objects is not a duplicate."""
    api, op, node, _ = _api_with_roles(tmp_path)
    assert await _answer(api, _post("/v1/node/topology/rate", b'{"rate_bytes_s": 5}')) == (200, {"rate": 5})
    status, doc = await _answer(api, _post("/v1/generate", b'{"prompt": "x", "constants": {"prompt": 1}}'))
    assert "duplicate" not in doc.get("error", ""), doc


def test_ctl_shows_a_duplicate_key_refusal_as_a_usage_error(tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    """giaannctl sends a dict (no duplicates of its own); a daemon's 400 for a body is exit 2."""
    with serving(tmp_path) as (api, data_dir):
        api.on("POST", "/v1/node/topology/rate",
               {"error": "duplicate key 'rate_bytes_s' in the request body", "code": "bad_request"}, status=400)
        assert ctl.main(["--data-dir", str(data_dir), "node", "topology", "rate", "5"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("giaannctl: error: ") and "duplicate key 'rate_bytes_s'" in err, err
