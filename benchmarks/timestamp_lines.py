"""Follow a growing log file and copy each complete line, with the time it appeared, to a TSV.

Usage: ``python3 benchmarks/timestamp_lines.py LOG OUT_TSV`` in the background; stop it with
SIGTERM (it reads what is left, then exits).

Why a follower and not a pipe: a memcheck pass cut by ``timeout`` can leave pytest workers
alive, and they hold any pipe's write end open, so a filter reading the pipe would never see
end of file and the device call would hang. Following the file has no such dependency.

Each output line is ``<unix seconds>\\t<line>``. A line's time is when the follower saw it,
never earlier than when it was written; ``memcheck_triage.py`` relies on that bound.
"""

import os
import signal
import sys
import time

POLL_S = 0.2


def follow(log_path, tsv_path):
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(True))
    while not os.path.exists(log_path) and not stop:
        time.sleep(POLL_S)
    pending = b""
    with open(log_path, "rb") as log, open(tsv_path, "w", buffering=1) as out:
        while True:
            chunk = log.read()
            now = time.time()
            if chunk:
                pending += chunk
                *lines, pending = pending.split(b"\n")
                for line in lines:
                    out.write(f"{now:.3f}\t{line.decode('utf-8', 'replace')}\n")
            elif stop:
                break
            else:
                time.sleep(POLL_S)
        if pending:  # the last line of a cut run may have no newline
            out.write(f"{time.time():.3f}\t{pending.decode('utf-8', 'replace')}\n")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    follow(sys.argv[1], sys.argv[2])
