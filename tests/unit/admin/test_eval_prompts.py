"""``giaannctl eval --prompts FILE`` (issue 17): the flag is declared once and sent like a corpus path:
a relative path as typed (the daemon takes it inside ``compute.corpus-dir``), an absolute one as is."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from giaannd.admin import ctl
from giaannd.operations import OPERATIONS


class _Client:
    def __init__(self) -> None:
        self.requests: list[tuple[str, str, Any, Any]] = []

    def call(self, method: str, path: str, body: Any = None, query: Any = None) -> Any:
        self.requests.append((method, path, body, query))
        return {"top1": 1.0}


def test_ctl_eval_sends_the_prompt_file_like_a_corpus_path(tmp_path: Path) -> None:
    client = _Client()
    for typed, sent in (("rel/prompts.txt", "rel/prompts.txt"), (str(tmp_path / "p.txt"), str(tmp_path / "p.txt"))):
        args = ctl.build_parser().parse_args(["eval", "--prompts", typed, "--limit", "5"])
        assert args.op is OPERATIONS["eval"]
        assert ctl.run(client, args.op, args) == {"top1": 1.0}  # type: ignore[arg-type]
        assert client.requests.pop() == ("POST", "/v1/eval", {"prompts": sent, "limit": 5}, None)
