"""The one error type that means "the user asked for something invalid".

Entry points turn it into a one-line message and exit status 2; anything else is a bug and
keeps its traceback.
"""


class UsageError(Exception):
    """Bad input: the message names the problem and, where there are any, the valid choices."""


def choices(names) -> str:
    return ", ".join(sorted(names))
