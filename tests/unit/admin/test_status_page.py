"""The status page's HTML (giaannd/admin/status_page.py); its behaviour in a browser is checked by
tests/integration/test_status_page.py."""

from __future__ import annotations

from giaannd.admin.status_page import render_status_page


def test_status_page_escapes_server_rendered_values_and_has_every_section() -> None:
    evil = "<script>alert(1)</script>"
    page = render_status_page({"node_name": evil, "state": "running", "services": {"x": {"a": evil}}},
                              [{"name": evil, "status": "alive"}])
    assert evil not in page and "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    for section in ("node", "members", "ring", "storage", "jobs"):
        assert f"<section id='{section}'" in page
    for url in ("/v1/status", "/v1/members", "/v1/ring", "/v1/ring/usage", "/v1/jobs"):
        assert f'"{url}"' in page
    assert "innerHTML" not in page  # data reaches the DOM as text only
    assert "http://" not in page and "https://" not in page  # no external assets


def test_status_page_without_membership_says_so() -> None:
    page = render_status_page({"node_name": "n"}, None)
    assert "membership not running" in page
