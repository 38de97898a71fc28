"""``python -m kvcache ...``: the same command line as the ``kvcache`` console script."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
