"""The one error type that means "the user asked for something invalid".

Entry points turn it into a one-line message and exit status 2; anything else is a bug and
keeps its traceback.
"""

import argparse


class UsageError(Exception):
    """Bad input: the message names the problem and, where there are any, the valid choices."""


def choices(names) -> str:
    return ", ".join(sorted(names))


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (no usage dump) and exit status 2, like
    every other bad input."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")
