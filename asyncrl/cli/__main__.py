"""`python -m asyncrl.cli ...`, as the `asyncrl` command."""

import sys

from asyncrl.cli.main import main

sys.exit(main())
