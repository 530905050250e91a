"""``python -m tools.local_cluster``: the demo (``make demo``)."""

import sys

from tools.local_cluster.demo import main

sys.exit(main())
