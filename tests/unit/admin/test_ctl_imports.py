"""giaannctl loads the client side of the admin surface only: the package's server (``AdminApi``:
aiohttp, its routes) is imported on first use, not by every command (~0.2 s of each command's
start-up on this project's VM, Dec 2)."""

import subprocess
import sys


def _loaded_after(statement: str) -> set[str]:
    code = f"import sys\n{statement}\nprint('\\n'.join(sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    return set(out.stdout.split())


def test_giaannctl_does_not_import_the_admin_server():
    loaded = _loaded_after("import giaannd.admin.ctl")
    assert "giaannd.admin.ctl" in loaded
    assert "giaannd.admin.api" not in loaded and "aiohttp" not in loaded


def test_the_admin_server_is_still_a_name_of_the_package():
    loaded = _loaded_after("from giaannd.admin import AdminApi, AdminHTTPError\nassert AdminApi.__name__ == 'AdminApi'")
    assert "giaannd.admin.api" in loaded
