"""giaannd: the daemon that runs GIAANN, a concept-column language network, across a cluster."""

__version__ = "0.1.0"
