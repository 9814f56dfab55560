import sys

from prorsa.cli import main

sys.exit(main())
