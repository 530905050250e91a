"""``python -m giaannd``: the same entry point as the installed ``giaannd`` script."""

import sys

from giaannd.cli import main

sys.exit(main())
