import msgspec
import pytest

from peers.membership import MembershipConfig, MetaTooLargeError, NodeMeta


@pytest.mark.parametrize("name", ["lan", "wan", "loopback", "loopback-test"])
def test_profiles_are_valid_and_probe_timeout_below_interval(name):
    config = MembershipConfig.profile(name)
    again = msgspec.convert(msgspec.to_builtins(config), MembershipConfig)
    assert again == config
    assert config.probe_timeout_s < config.probe_interval_s


def test_unknown_profile_and_bad_values_are_clear_errors():
    with pytest.raises(ValueError, match="unknown membership profile"):
        MembershipConfig.profile("nope")
    with pytest.raises(msgspec.ValidationError, match="probe-interval-s"):
        msgspec.convert({"probe-interval-s": -1}, MembershipConfig)
    with pytest.raises(msgspec.ValidationError, match="unknown"):
        msgspec.convert({"no-such-field": 1}, MembershipConfig)


def test_every_config_field_is_documented():
    schema = msgspec.json.schema(MembershipConfig)
    props = schema["$defs"]["MembershipConfig"]["properties"]
    assert all(len(p.get("description", "")) > 30 for p in props.values())


def test_node_meta_roundtrip_and_limit():
    meta = NodeMeta(roles=("storage", "compute"), transports={"tcp": "tcp://10.0.0.1:7400"},
                    capacity_bytes=1 << 34, weight=2.0)
    assert NodeMeta.decode(meta.encode()) == meta
    assert NodeMeta.decode(b"") == NodeMeta()
    with pytest.raises(MetaTooLargeError):
        NodeMeta(transports={f"t{i}": "x" * 40 for i in range(20)}).encode()
    with pytest.raises(ValueError, match="bad node metadata"):
        NodeMeta.decode(b"\xc1")
