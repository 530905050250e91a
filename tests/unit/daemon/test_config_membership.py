"""The [membership] section: profile + per-knob overrides, one source of truth in peers."""

from __future__ import annotations

import msgspec
import pytest

from giaannd.config import Config, load_config, membership_profile_values, to_toml
from giaannd.errors import ConfigError
from peers.membership.config import MembershipConfig as PeersMembershipConfig


def test_config_membership_unset_knobs_take_the_profile() -> None:
    for profile in ("loopback", "lan", "wan"):
        cfg = load_config(environ={}, overrides=[f"membership.profile={profile}"])
        assert cfg.membership.resolved() == PeersMembershipConfig.profile(profile)


def test_config_membership_every_peers_knob_is_a_key_with_its_description() -> None:
    ours = {f.encode_name for f in msgspec.structs.fields(type(Config().membership))}
    theirs = {f.encode_name for f in msgspec.structs.fields(PeersMembershipConfig)}
    assert theirs <= ours
    assert {"profile", "bind-address", "bind-port", "advertise-address"} <= ours


def test_config_membership_override_changes_one_knob_only() -> None:
    cfg = load_config(environ={"GIAANND_MEMBERSHIP__GOSSIP_NODES": "5"},
                      overrides=["membership.profile=wan", "membership.lifeguard=false"])
    resolved = cfg.membership.resolved()
    wan = PeersMembershipConfig.wan()
    assert (resolved.gossip_nodes, resolved.lifeguard) == (5, False)
    assert resolved.probe_interval_s == wan.probe_interval_s


@pytest.mark.parametrize(("override", "path"), [
    ("membership.probe-interval-s=0", "$.membership.probe-interval-s"),
    ("membership.awareness-max-multiplier=9", "$.membership.awareness-max-multiplier"),
    ("membership.probe-timeout-s=5.0", "$.membership.probe-timeout-s"),  # >= lan's interval
    ("membership.no-such-knob=1", "$.membership.no-such-knob"),
])
def test_config_membership_bad_knob_names_the_key(override: str, path: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(environ={}, overrides=[override])
    assert info.value.path == path and info.value.exit_code == 2


def test_config_membership_toml_round_trip_keeps_unset_and_set_knobs() -> None:
    cfg = load_config(environ={}, overrides=["membership.retransmit-mult=7"])
    text = to_toml(cfg)
    assert "retransmit-mult = 7" in text
    assert "# probe-interval-s = 1.0  (unset: from the profile)" in text
    assert load_config(environ={}, overrides=[]) != cfg
    import tomllib
    again = msgspec.convert(tomllib.loads(text), Config)
    assert again == cfg


def test_config_membership_profile_values_for_docs() -> None:
    assert membership_profile_values("probe_interval_s") == {"loopback": 0.2, "lan": 1.0,
                                                             "wan": 5.0}
