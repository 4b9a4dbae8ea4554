"""The `cullama` command line: a thin click layer over the library (parsing and printing only)."""

import sys

from ..common.errors import INTERRUPTED


def run() -> None:
    """The `cullama` console script. The commands import inside it, so that a Ctrl-C while they do exits with
    130 and one line, as it does later, not with the import's traceback."""
    try:
        from .main import main
    except KeyboardInterrupt:
        sys.stderr.write("interrupted\n")
        sys.exit(INTERRUPTED)
    main()
