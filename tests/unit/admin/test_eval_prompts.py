"""``giaannctl eval --prompts FILE`` (issue 17): the flag is declared once and sent as an absolute path."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from giaannd.admin import ctl
from giaannd.operations import OPERATIONS


class _Client:
    def __init__(self) -> None:
        self.requests: list[tuple[str, str, Any, Any]] = []

    def json(self, method: str, path: str, body: Any = None, query: Any = None) -> Any:
        self.requests.append((method, path, body, query))
        return {"top1": 1.0}


def test_ctl_eval_sends_the_prompt_file_as_an_absolute_path() -> None:
    args = ctl.build_parser().parse_args(["eval", "--prompts", "rel/prompts.txt", "--limit", "5"])
    assert args.op is OPERATIONS["eval"]
    client = _Client()
    assert ctl.run(client, args.op, args) == {"top1": 1.0}  # type: ignore[arg-type]
    assert client.requests == [("POST", "/v1/eval", {"prompts": str(Path("rel/prompts.txt").resolve()),
                                                      "limit": 5}, None)]
