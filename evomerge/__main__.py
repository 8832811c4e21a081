"""``python -m evomerge``: the ``evomerge`` command (where its script is not on the PATH)."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
