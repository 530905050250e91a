"""Daemon services that are not roles: membership (gossip + the admin routes that act on it) and
the adapters that build role services on the shared node runtime."""

from giaannd.services.membership import MembershipService

__all__ = ["MembershipService"]
