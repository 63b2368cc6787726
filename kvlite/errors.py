"""The one exception type a user sees: its message is printed as a one-line error by the CLI."""


class KvliteError(Exception):
    """A problem with the user's input or environment, with a message that says what to do."""
