"""The one exception type that means "the user asked for something we cannot do"."""


class UserError(Exception):
    """Bad input: shown to the user as one line, never as a traceback."""
