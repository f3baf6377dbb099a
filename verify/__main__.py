"""``python -m verify``: the same command line as the ``lce-verify`` console script."""

import sys

from verify.cli import main

sys.exit(main())
