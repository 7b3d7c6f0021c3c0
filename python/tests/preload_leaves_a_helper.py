"""A preloaded module that starts a helper in a session of its own and then
stops reaping children (SIGCHLD ignored): the preloader fails at its first
fork, and the helper, outside its process group, would outlive it unless
berth sweeps what a preloader started when it ends (tests/tests/preload.rs).
The helper's pid goes to the file ``BERTH_TEST_PID_FILE`` names."""

import os
import signal
import subprocess

_helper = subprocess.Popen(["sleep", "1000"], start_new_session=True)
with open(os.environ["BERTH_TEST_PID_FILE"], "w") as _f:
    _f.write(str(_helper.pid))
signal.signal(signal.SIGCHLD, signal.SIG_IGN)
