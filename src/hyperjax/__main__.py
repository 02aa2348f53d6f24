"""``python -m hyperjax``: the command line."""

import sys

from hyperjax.cli.main import main

sys.exit(main())
