"""The `deltaserve` console script: `deltaserve.server.cli.main`, imported inside the same
Ctrl-C handling as the rest of start-up. The CLI module pulls in fastapi and pydantic (about
half a second); a Ctrl-C there used to end in a traceback."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from deltaserve.server.cli_exit import interrupted  # standard library only: cheap


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI (cli.main) on argv (default sys.argv[1:]); its exit status. A Ctrl-C while
    the CLI's modules import prints one line and returns 130, as cli.main does later."""
    try:
        from deltaserve.server.cli import main as cli_main
    except KeyboardInterrupt:
        return interrupted()
    return cli_main(argv)


if __name__ == "__main__":
    sys.exit(main())
