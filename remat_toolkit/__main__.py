"""``python -m remat_toolkit``: the same as the ``remat-toolkit`` command."""

import sys

from remat_toolkit._src.cli.main import main

if __name__ == "__main__":
  sys.exit(main())
