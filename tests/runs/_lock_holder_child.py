"""Child process for test_lock.py: opens a CheckpointManager on RUN_DIR (taking the run's writer
lock), prints "locked" and then sleeps until it is killed.

Usage: python -W error _lock_holder_child.py RUN_DIR
"""

from __future__ import annotations

import sys
import time


def main() -> None:
    import savepoint as sp

    manager = sp.CheckpointManager(sys.argv[1])  # held (and locked) until the test kills us
    print("locked", manager.directory, flush=True)
    while True:
        time.sleep(60)


if __name__ == "__main__":
    main()
