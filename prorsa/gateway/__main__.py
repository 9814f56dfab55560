"""`python -m prorsa.gateway ...` is `prorsa gateway ...` (how `prorsa up` starts it, like every service)."""

import sys

from prorsa.cli import main

sys.exit(main(["gateway", *sys.argv[1:]]))
