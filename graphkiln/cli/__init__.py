"""The ``graphkiln`` command: export, inspect, run, chat, verify, check, build, serve, demo.

Every user error surfaces as one ``error: ...`` line on stderr and exit status 2. Modules, one job
each: ``entry`` (``main``, the entry point, and its error contract), ``parser`` (every command's flags),
``arg_types`` (flag values checked as they are parsed), ``flags`` (flag groups several commands
share, and flags given where they would do nothing), ``commands`` (the commands' bodies).
"""

from graphkiln.cli.entry import main

__all__ = ["main"]
