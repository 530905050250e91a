"""``compute.lexicon``: a compute node reads the ever-POS lexicon the config names (issue 17)."""

from __future__ import annotations

from pathlib import Path

import pytest

from giaannd.compute.service import create_service
from giaannd.config import ComputeConfig, Config
from giaannd.model.lexicon import LexiconFileError, PosClass
from giaannd.services.roles import create_compute_service


def _config(tmp_path: Path, lexicon: str) -> Config:
    base = Config.loopback(str(tmp_path), roles=["compute"])
    return Config(node=base.node, admin=base.admin, transport=base.transport, membership=base.membership,
                  storage=base.storage, compute=ComputeConfig(lexicon=lexicon))


@pytest.mark.parametrize("factory", ["compute.service.create_service", "daemon role (services.roles)"])
@pytest.mark.asyncio
async def test_compute_node_loads_the_configured_lexicon(tmp_path: Path, factory: str) -> None:
    (tmp_path / "lex.tsv").write_text("zork\tVERB\n", encoding="utf-8")
    config = _config(tmp_path, "lex.tsv")  # relative to data-dir
    # The daemon builds its compute role through services.roles (with the node runtime, only
    # asked for a storage client once started under a context): both must honour the knob.
    service = create_service(config) if factory.startswith("compute") else create_compute_service(config, None)
    await service.start(None)
    try:
        lexicon = service._lexicon  # what training jobs and prompt assigners are given
        assert lexicon is not None and lexicon.classes("zork") == PosClass.VERB
        assert lexicon.classes("sat") == PosClass.NONE  # not the shipped lexicon
    finally:
        await service.stop(graceful=False)


@pytest.mark.asyncio
async def test_an_unreadable_lexicon_stops_the_node_at_start(tmp_path: Path) -> None:
    service = create_service(_config(tmp_path, str(tmp_path / "absent.pkl.gz")))
    with pytest.raises(LexiconFileError, match="absent.pkl.gz: cannot read"):
        await service.start(None)
