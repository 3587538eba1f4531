"""``python -m kiproxy``: the same as the ``kiproxy`` command."""

import sys

from kiproxy.cli import main

if __name__ == "__main__":
    sys.exit(main())
