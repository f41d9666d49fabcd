"""The ``hybridkv`` command: typer apps that command modules register on, and its one error path.

Invariants (``main``):
- A user error — a bad option (click's usage errors), or an input the library refuses with one
  of its own errors (``ValueError`` family, ``OSError``, memory / transfer / replay / tier refusals) —
  prints exactly one line ``error: ...`` on stderr and exits 2. No traceback, unless
  ``--debug`` is given (anywhere on the command line), which re-raises.
- Anything else is a bug: one line naming the exception type, exit 1 (``--debug`` shows it).
- Importing the CLI imports no torch: command modules import the library inside their commands,
  after typer has parsed and checked the options, so a usage error is answered in a fraction of a
  second even where torch takes many seconds to load. The library's error classes are looked up in
  ``sys.modules`` (a class whose module was never imported cannot have been raised).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import typer

app = typer.Typer(
    help="hybridkv: memory, prefix cache and PD transfer for hybrid LLMs.",
    no_args_is_help=True,
    add_completion=False,
)
bench_app = typer.Typer(help="Benchmarks, side by side with a baseline in the same run.", no_args_is_help=True)
app.add_typer(bench_app, name="bench")

USER_ERRORS: tuple[type[BaseException], ...] = (ValueError, OSError, OverflowError)
LIBRARY_USER_ERRORS = (  # (module, class): the library's refusals of an input
    ("hybridkv.memory.errors", "MemoryPoolError"),
    ("hybridkv.replay.simulator", "ReplayError"),
    ("hybridkv.transfer.errors", "TransferError"),
    ("hybridkv.tiers.base", "TierError"),
)
DEBUG_FLAG = "--debug"


def is_user_error(exc: BaseException) -> bool:
    """Whether ``exc`` refuses an input (printed as one ``error:`` line) rather than showing a bug."""
    if isinstance(exc, USER_ERRORS):
        return True
    for module_name, class_name in LIBRARY_USER_ERRORS:
        module = sys.modules.get(module_name)
        if module is not None and isinstance(exc, getattr(module, class_name)):
            return True
    return False


def _one_line(text: str) -> str:
    return " ".join(str(text).split()) or "(no message)"


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit status (the console script exits with it)."""
    args = list(sys.argv[1:] if argv is None else argv)
    debug = DEBUG_FLAG in args
    args = [a for a in args if a != DEBUG_FLAG]
    try:
        result = app(args=args, prog_name="hybridkv", standalone_mode=False)
    except typer.Exit as done:
        return done.exit_code
    except typer.TyperException as exc:  # click's usage errors (typer vendors click)
        if debug:
            raise
        message = exc.format_message()
        if message:  # an empty one: the command printed its help (called with no arguments)
            ctx = getattr(exc, "ctx", None)
            hint = f" (see `{ctx.command_path} --help`)" if ctx is not None else ""
            print(f"error: {_one_line(message)}{hint}", file=sys.stderr)
        return 2
    except typer.Abort:
        print("error: aborted", file=sys.stderr)
        return 130
    except Exception as exc:
        if debug:
            raise
        if is_user_error(exc):
            print(f"error: {_one_line(str(exc))}", file=sys.stderr)
            return 2
        name = type(exc).__name__
        print(f"error: internal error {name}: {_one_line(str(exc))} (rerun with --debug)", file=sys.stderr)
        return 1
    return result if isinstance(result, int) else 0
