"""One exception type for everything a user can get wrong.

The CLI turns it into a single line on stderr and exit code 2, never a traceback.
"""


class UserError(Exception):
    """Bad input from a user: a flag, a config file, a path. The message names the problem and the fix."""

    exit_code = 2


class InternalError(Exception):
    """A bug in collab or a dependency; the CLI prints one line and where the full traceback went."""

    exit_code = 1
