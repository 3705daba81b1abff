#!/usr/bin/env python3
"""`weightsync subscriber` as a script: `python cmd/subscriber.py --help`.

A thin wrapper: the entry point lives in weightsync/cli.py (console script `weightsync`). This
folder has no __init__.py on purpose: a package named `cmd` would shadow Python's own `cmd` module.
"""

import sys

from weightsync.cli import main

if __name__ == "__main__":
    sys.exit(main(["subscriber", *sys.argv[1:]]))
