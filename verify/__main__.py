"""``python -m verify``: the same command line as the ``lce-verify`` console script."""

import sys

from verify.cli import main

if __name__ == "__main__":  # not when a fork server's worker imports this module as __mp_main__
    sys.exit(main())
