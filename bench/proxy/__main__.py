"""``python -m bench.proxy``: see :mod:`bench.proxy`."""

import sys

from bench.proxy.matrix import main

sys.exit(main())
