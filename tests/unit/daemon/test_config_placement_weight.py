"""``storage.placement-weight`` is not used by placement yet (the daemon places with the unweighted
strategy), so a value other than its default is refused at load instead of silently doing
nothing."""

from __future__ import annotations

from pathlib import Path

import pytest

from giaannd.config import load_config
from giaannd.errors import ConfigError


@pytest.mark.parametrize("weight", ["2", "0.5", "9.0", "1000"])
def test_config_placement_weight_other_than_1_is_refused(tmp_path: Path, weight: str) -> None:
    """It was taken, recorded in the ring and gossiped, and every storage node still owned the same
    share (weights 1 and 9 gave 50.2 % and 49.8 % of 100,000 keys): an operator sizing nodes by it
    got nothing, without a word."""
    with pytest.raises(ConfigError, match="not supported yet") as info:
        load_config(environ={}, overrides=[f"storage.placement-weight={weight}"])
    assert info.value.path == "$.storage.placement-weight" and info.value.exit_code == 2
    assert "stream" in str(info.value) and "\n" not in str(info.value)  # says why
    path = tmp_path / "giaannd.toml"
    path.write_text(f"[storage]\nplacement-weight = {weight}\n")
    with pytest.raises(ConfigError) as info:
        load_config(path, environ={})
    assert info.value.path == "$.storage.placement-weight"


def test_config_placement_weight_default_is_taken(tmp_path: Path) -> None:
    """Files that spell out the default (1, as placement uses for every node) still load."""
    assert load_config(environ={}).storage.placement_weight == 1.0
    assert load_config(environ={}, overrides=["storage.placement-weight=1"]).storage.placement_weight == 1.0
    path = tmp_path / "giaannd.toml"
    path.write_text("[storage]\nplacement-weight = 1.0\n")
    assert load_config(path, environ={}).storage.placement_weight == 1.0
