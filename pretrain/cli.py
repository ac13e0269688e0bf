"""How the command-line tools end on an error: one line on stderr and exit code 2, whatever the
error; the traceback only with --debug (then the error propagates)."""

import argparse
import sys
from collections.abc import Callable

from pretrain.checkpointing import first_line

EXIT_ERROR = 2


def add_debug_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error")


def run_command(prog: str, command: Callable[[], int], *, debug: bool) -> int:
    """Returns command()'s exit code, or EXIT_ERROR after printing the error in one line.
    KeyboardInterrupt passes through. Our own errors (ValueError, OSError and RuntimeError
    subclasses: config, data, checkpoint and run errors) print their message; anything else is
    named as unexpected."""
    try:
        return command()
    except KeyboardInterrupt:
        raise
    except Exception as e:
        if debug:
            raise
        if isinstance(e, (ValueError, OSError, RuntimeError)) and str(e):
            message = first_line(e)
        else:
            message = f"unexpected {type(e).__name__}: {first_line(e)} (--debug shows where)"
        print(f"{prog}: error: {message}", file=sys.stderr)
        return EXIT_ERROR
