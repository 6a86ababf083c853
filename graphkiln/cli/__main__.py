"""``python -m graphkiln.cli``: the ``graphkiln`` command."""

import sys

from graphkiln.cli.entry import main

sys.exit(main())
