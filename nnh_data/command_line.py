"""What the ``nnh-data`` and ``nnh-precompute`` commands share: an error is one line on
stderr, ``PROG: error: REASON``, and exit status 2, never a traceback.

Design. A command's user needs the reason, not the stack: nnh's own errors, ``ValueError`` and
``OSError`` say it in their message; any other exception (a storage client's
``EndpointConnectionError``, say) is named by its type before its message, so nothing is lost
but the frames. A message of several lines is joined into one, so a script that reads stderr
line by line sees one error per failed command.
"""

from __future__ import annotations

import argparse

from nnh_data.errors import NNHError

__all__ = ["OneLineParser", "error_line"]

_PLAIN = (NNHError, ValueError, OSError)  # their message says what went wrong


class OneLineParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose usage errors are one line (no usage block), status 2; its
    subcommands' parsers are of this class too."""

    def error(self, message: str) -> None:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def error_line(prog: str, error: BaseException) -> str:
    """``error`` as one line for ``prog``'s stderr (newline included).

    Example:
        >>> error_line("nnh-data", KeyError("num_samples"))
        "nnh-data: error: KeyError: 'num_samples'\\n"
    """
    text = "; ".join(line.strip() for line in str(error).splitlines() if line.strip())
    if not isinstance(error, _PLAIN) or not text:
        text = f"{type(error).__name__}: {text}" if text else type(error).__name__
    return f"{prog}: error: {text}\n"
