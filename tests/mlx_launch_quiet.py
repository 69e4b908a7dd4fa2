"""mlx.launch without its busy wait: `python mlx_launch_quiet.py ARGS` runs mlx.launch's own main on ARGS.

mlx.launch (mlx 0.32) select()s on each rank's stdin pipe, which is always writable, so its loop never
waits: the launcher spins a whole core while the ranks run (on CI's 2 cores, the ranks' share of the CPU).
Here a select() that found nothing to read sleeps 10 ms, and the launcher's own stdin is a pipe nobody
writes (at end of input its main loop spins the same way). Everything else is mlx.launch's.
"""

import os
import sys
import time

from mlx._distributed_utils import launch

_select = launch.select


def _select_without_spinning(rlist, wlist, xlist, timeout=None):
    ready = _select(rlist, wlist, xlist, timeout)
    if not ready[0] and timeout:  # only writable pipes: the caller would loop at once
        time.sleep(0.01)
    return ready


if __name__ == "__main__":
    launch.select = _select_without_spinning
    _quiet_stdin = os.pipe()  # the write end stays open: fd 0 never reads as end of input
    os.dup2(_quiet_stdin[0], 0)
    sys.argv[0] = "mlx.launch"
    sys.exit(launch.main())
