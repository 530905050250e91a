"""peers: the GIAANN-agnostic peer-to-peer layer (membership, transport, wire, placement)."""
