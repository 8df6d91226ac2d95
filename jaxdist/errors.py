"""The one error type that means "the user asked for something invalid".

Entry points turn it into a one-line message and exit status 2; anything else is a bug and
keeps its traceback.
"""

import argparse
import sys
import textwrap


class UsageError(Exception):
    """Bad input: the message names the problem and, where there are any, the valid choices."""


class WriteError(UsageError):
    """An output could not be written (a full disk, a file-size limit): one line naming the
    path and what was kept; the run's exit status is 1, not bad input's 2."""


def choices(names) -> str:
    return ", ".join(sorted(names))


def did_you_mean(name: str, names) -> str:
    """" (did you mean 'y'?)" naming the two nearest of `names`: those that begin with
    `name` (shortest first: h100 begins h100-sxm), then difflib's closest; "" where none is
    near."""
    import difflib

    names, name = list(names), str(name)
    begin = sorted((n for n in names if len(name) >= 3 and n.startswith(name)), key=len)
    close = difflib.get_close_matches(name, names, n=2, cutoff=0.75)
    near = list(dict.fromkeys(begin + close))[:2]
    return f" (did you mean {' or '.join(repr(n) for n in near)}?)" if near else ""


def unknown(what: str, name: str, names) -> str:
    """"unknown WHAT 'x' (did you mean 'y'?); choose from ..." — the nearest names first."""
    return f"unknown {what} {name!r}{did_you_mean(name, names)}; choose from {choices(names)}"


def path_arg(text: str) -> str:
    """The argparse type of every option that names a file or folder: a path no file can
    have (a name longer than the file system allows, a symlink loop, a NUL byte) is the
    parser's one line; Path.exists() raised it as a traceback wherever it was first read."""
    import errno
    import os

    shown = text if len(text) <= 60 else text[:57] + "..."
    try:
        os.stat(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{shown!r} holds a NUL byte") from None
    except OSError as e:
        if e.errno in (errno.ENAMETOOLONG, errno.ELOOP):
            raise argparse.ArgumentTypeError(f"{shown}: {e.strerror}") from None
    return text


class NameKeepingFormatter(argparse.HelpFormatter):
    """Help text wrapped at spaces only: the default also breaks at hyphens, which splits
    names in the lists (`gpt-` / `small`, `convnext_large-` / `imagenet`)."""

    def _split_lines(self, text, width):
        text = self._whitespace_matcher.sub(" ", text).strip()
        return textwrap.wrap(text, width, break_on_hyphens=False, break_long_words=False)


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (no usage dump) and exit status 2, like
    every other bad input; and an option listed in `dash_values` takes a value that itself
    begins with "-" (`--xla-flags --xla_foo=1`), which plain argparse reads as a missing
    value."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", NameKeepingFormatter)
        super().__init__(*args, **kwargs)
        self.dash_values: set[str] = set()
        # {dest: () -> text} appended to an option's help when the help is printed: the
        # registries' names need jax and flax imported, which a parse must not wait for
        self.late_help: dict = {}

    def format_help(self):
        late, self.late_help = self.late_help, {}
        for action in self._actions:
            if action.dest in late and action.help:  # before add_arguments' "(default: x)"
                text, sep, default = action.help.partition(" (default:")
                action.help = text + late[action.dest]() + sep + default
        return super().format_help()

    def parse_known_args(self, args=None, namespace=None):
        args = sys.argv[1:] if args is None else list(args)
        return super().parse_known_args(self._join_dash_values(args), namespace)

    def _join_dash_values(self, args: list[str]) -> list[str]:
        """`--xla-flags --xla_foo=1` -> `--xla-flags=--xla_foo=1`. The next token is joined
        only when it is not one of this parser's own options, so `--xla-flags --steps 3`
        stays the usual 'expected one argument'."""
        out, i = [], 0
        while i < len(args):
            token = args[i]
            if token == "--":  # everything after is positional
                return out + args[i:]
            nxt = args[i + 1] if i + 1 < len(args) else None
            if (token in self.dash_values and nxt is not None and nxt.startswith("-")
                    and nxt.split("=", 1)[0] not in self._option_string_actions):
                out.append(f"{token}={nxt}")
                i += 2
                continue
            out.append(token)
            i += 1
        return out

    def require_at_least(self, args, **minimums: int) -> None:
        """One line and exit 2 for an option below its minimum: `--steps 0` where a count
        of steps divides a total later (benchmarks' ZeroDivisionError) or indexes rounds."""
        for dest, low in minimums.items():
            value = getattr(args, dest)
            if value < low:
                self.error(f"--{dest.replace('_', '-')} must be at least {low}, got {value}")

    @property
    def short_name(self) -> str:
        """The name an entry point's errors start with, as its own checks print them:
        `run` for `python -m experiments.run` (`run: error: ...`), `ps.server` for `python
        -m ps.server`."""
        return self.prog.split()[-1].removeprefix("experiments.")

    def error(self, message):
        self.exit(2, f"{self.short_name}: error: {message} (see --help)\n")
