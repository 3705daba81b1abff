#!/usr/bin/env python3
"""`weightsync publisher` as a script: `python cmd/publisher.py --help`.

A thin wrapper: the entry point lives in weightsync/cli.py (console script `weightsync`). This
folder has no __init__.py on purpose: a package named `cmd` would shadow Python's own `cmd` module.
"""

import sys

from weightsync.cli import main

if __name__ == "__main__":
    sys.exit(main(["publisher", *sys.argv[1:]]))
