"""Admin surface: the HTTP API served by the daemon and the giaannctl client."""

from giaannd.admin.api import AdminApi, AdminHTTPError

__all__ = ["AdminApi", "AdminHTTPError"]
