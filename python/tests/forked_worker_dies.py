"""A module whose at-fork hook ends every worker a preloader forks, right
after the fork, while the preloader's own fork protocol completes: the
worker dies before its hello, where a cold start (which never imports
this module) works (tests/tests/preload.rs)."""

import os

_preloader = os.getpid()


def _after_in_child() -> None:
    # The worker is the second fork's child: its parent is not the
    # preloader but the intermediate process.
    if os.getppid() != _preloader and os.getpid() != _preloader:
        os._exit(7)


os.register_at_fork(after_in_child=_after_in_child)
