"""The one exception type the CLI turns into a one-line message (problem and fix)."""


class GlaswapError(Exception):
    """A problem the user can fix: the message names it and says how."""
