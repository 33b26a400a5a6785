"""``python -m flows.cli COMMAND``: the ``shardflow`` command where it is not installed."""

import sys

from flows.cli.shardflow import main

if __name__ == "__main__":
    sys.exit(main())
