"""Admin surface: the HTTP API served by the daemon and the giaannctl client."""

from giaannd.admin.api import AdminApi
from giaannd.errors import AdminHTTPError

__all__ = ["AdminApi", "AdminHTTPError"]
