"""Progress bar rendering (pure) and its non-TTY output."""

from __future__ import annotations

import io

import pytest

from giaannd.sdk.progress import ProgressBar, render_bar


@pytest.mark.parametrize(("done", "total", "elapsed", "expected"), [
    (0, 10, 0.0, "[..........]   0% 0/10 s 0.0/s"),
    (5, 10, 1.0, "[#####.....]  50% 5/10 s 5.0/s eta 1s"),
    (10, 10, 2.0, "[##########] 100% 10/10 s 5.0/s"),
    (12, 10, 2.0, "[##########] 100% 12/10 s 6.0/s"),
    (7, None, 2.0, "7 s 3.5/s"),
    (7, 0, 2.0, "7 s 3.5/s"),
])
def test_progress_render_bar(done: int, total: int | None, elapsed: float, expected: str) -> None:
    assert render_bar(done, total, "s", elapsed, width=10) == expected


def test_progress_non_tty_logs_each_tenth_once() -> None:
    out = io.StringIO()
    bar = ProgressBar(out, "job 1")
    for done in range(0, 101, 5):
        bar.update(done, 100, "sentences")
    bar.close("succeeded")
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue()
    assert len(lines) == 12  # 0%, 10%, ..., 100%, then the final line
    assert lines[-1] == "job 1 succeeded"
