"""The one exception type users see.

Every failure a user can cause (bad checkpoint, bad artifact, bad prompt) raises
``GraphkilnError`` with a single-line message naming the problem and the fix; the CLI prints
it as ``error: ...`` and exits non-zero. Anything else escaping is a bug in graphkiln.
"""


class GraphkilnError(Exception):
    """A user-facing failure: ``str(err)`` is one line saying what is wrong and how to fix it."""
