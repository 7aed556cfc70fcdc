"""Imported first by the fork server (deploy/launcher.py PRELOAD): it leaves the process group
of the process that started it.

A signal sent to the supervisor's whole process group (``timeout``, ``kill -TERM -PGID``, a
job runner stopping a job) would otherwise end the fork server at once. The parts do not need
it any more (each runs in a session of its own), but the supervisor sees its parts through it:
with the fork server gone every part looks ended (exit code 255) while it still runs, so the
supervisor would stop none of them in order, stop the nats-server under the monitor and the
recorder, and leave them to notice on their own. Out of the group, the signal reaches the
supervisor, which stops its parts as on Ctrl-C; the fork server still ends after its starter
(multiprocessing's own pipe).

Only the fork server acts on this import: a process started as ``python -c`` whose
multiprocessing fork server module is loaded, and whose parent named itself (its pid) in
``JETRL_FORK_SERVER_STARTER`` before starting it (deploy/launcher.py).
"""

from __future__ import annotations

import contextlib
import os
import sys

from jetrl.deploy.launcher import FORK_SERVER_STARTER


def is_fork_server() -> bool:
    starter = os.environ.get(FORK_SERVER_STARTER, "")
    return (
        starter.isdigit()
        and os.getppid() == int(starter)
        and sys.argv[:1] == ["-c"]
        and "multiprocessing.forkserver" in sys.modules
    )


def leave_starter_group() -> bool:
    """Leave the process group when this process is the fork server; whether it is."""
    if not is_fork_server():
        return False
    with contextlib.suppress(OSError):  # a session leader cannot: then it was never in the group
        os.setpgid(0, 0)
    return True


leave_starter_group()
