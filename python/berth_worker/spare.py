"""The preloader's spare worker: the next load's worker, forked ahead while
nobody waits, already the supervisor's child and in a cgroup made for it;
a fork frame is handed on to it whole (docs/wire.md §8, "The spare").
"""

from __future__ import annotations

import os
import socket
import sys
from typing import Any, Dict, List, Optional, Tuple

from .control import FORK_FDS, Control, send
from .environ_block import SPACE, mark_in_block, rewrite_environ
from .forking import (
    REPARENT_WAIT,
    already_in,
    become_worker,
    cgroup_folder,
    double_fork,
    join_cgroup,
    unsafe_to_fork,
    wait_for_the_supervisor,
)
from .process import arm_parent_death, parent_gone, say
from .wire import FrameError, encode_frame

class Spare:
    """A worker forked ahead of its load (as a fork frame's would be), so
    that a load does not wait for the fork: already the supervisor's child,
    waiting on a socket pair of its own for the fork frame the preloader
    hands on to it. One at a time; it shares all but a few pages with the
    preloader, and goes with it (it stays in the preloader's process group
    and sees its socket close)."""

    def __init__(self, pid: int, link: socket.socket, joined: Optional[Tuple[int, int]]) -> None:
        self.pid = pid
        self.link: Optional[socket.socket] = link
        #: The cgroup folder it joined (device, inode), if it joined one.
        self.joined = joined

    def fits(self, header: Dict[str, Any], fds: List[int]) -> bool:
        """Whether a fork frame is one to hand this spare: one a fork takes,
        naming the cgroup the spare joined (the supervisor made that one
        this worker's) or none. A frame naming another cgroup (two loads at
        once, the other took this spare's) is forked afresh and the spare
        kept for the frame that names its cgroup."""
        if len(fds) != FORK_FDS:
            return False
        procs = header.get("cgroup_procs")
        return not isinstance(procs, str) or self.joined is None or already_in(procs, self.joined)

    @staticmethod
    def make(sock: socket.socket, mark: Tuple[Optional[int], str], cgroup: Optional[str]) -> Any:
        """Forks a spare, which joins the cgroup whose ``cgroup.procs`` is
        ``cgroup`` (made for it by the supervisor, which makes it the
        worker's at the fork), and waits until it is the supervisor's child:
        the spare (``None`` if that failed, said why) in the preloader, and
        :data:`IN_SPARE` in the spare once it has been handed its load."""
        if unsafe_to_fork() is not None:
            return None  # the next fork frame says why
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        sys.stdout.flush()
        sys.stderr.flush()
        try:
            pid = double_fork()
        except ChildProcessError:
            # Something reaps this process's children (a preloaded module
            # ignoring SIGCHLD): it cannot tell a worker's fork worked, and
            # ends here, as it would at a fork frame.
            raise
        except OSError as e:
            ours.close()
            theirs.close()
            say("no spare worker: forking it failed: {}".format(e))
            return None
        if pid == 0:
            ours.close()
            _serve_as_spare(sock, theirs, mark, cgroup)
            return IN_SPARE
        theirs.close()
        spare = Spare(pid, ours, None)
        try:
            ours.settimeout(REPARENT_WAIT + 1.0)
            ready = ours.recv(1)
            ours.settimeout(None)
        except OSError as e:
            ready, why = b"", str(e)
        else:
            why = "it exited"
        if ready not in (b"r", b"j"):
            say("no spare worker: pid {} did not get ready ({})".format(pid, why))
            spare.close()
            return None
        if ready == b"j" and cgroup is not None:
            # It joined `cgroup`: that folder is its, whatever its name later.
            spare.joined = cgroup_folder(cgroup)
        return spare

    def close(self) -> None:
        """Lets it go: it sees its socket close and exits."""
        if self.link is not None:
            self.link.close()
            self.link = None


#: What :meth:`Spare.make` returns in the spare itself.
IN_SPARE = object()


def hand_to_spare(sock: socket.socket, spare: Spare, header: Dict[str, Any], fds: List[int]) -> bool:
    """Hands a fork frame (one it :meth:`~Spare.fits`) and its descriptors
    on to the spare and answers it with the spare's pid. False, nothing
    handed, if the spare is gone (then closed)."""
    if spare.link is None:
        return False
    try:
        socket.send_fds(spare.link, [encode_frame(header)], fds)
    except OSError:
        spare.close()
        return False
    spare.close()
    for extra in fds:
        os.close(extra)
    send(sock, {"type": "forked", "id": header.get("id"), "pid": spare.pid, "spare_kept": False})
    return True


def _serve_as_spare(
    sock: socket.socket,
    link: socket.socket,
    mark: Tuple[Optional[int], str],
    cgroup: Optional[str],
) -> None:
    """In the spare: waits to be the supervisor's child, joins its cgroup,
    says so, then waits for the fork frame the preloader hands on, and sets
    up as that worker. Exits (0) when the preloader goes without
    handing it one."""
    wait_for_the_supervisor()
    arm_parent_death()
    if parent_gone() is not None:
        os._exit(0)
    # Joined once it is the supervisor's child: the supervisor finds its
    # spare by its cgroup's members.
    joined = join_cgroup(cgroup) if cgroup is not None else None
    mark = _name_as_spare(mark)
    try:
        # Ready, and whether it is in the cgroup it was given.
        link.sendall(b"r" if joined is None else b"j")
        header, fds = Control(link).read()
    except (OSError, ValueError, EOFError, FrameError):
        os._exit(0)
    link.close()
    if len(fds) != FORK_FDS:
        os._exit(1)
    become_worker(sock, header, fds, mark, joined)


def _name_as_spare(mark: Tuple[Optional[int], str]) -> Tuple[Optional[int], str]:
    """Shows the spare for what it is where processes are told apart by
    their environment (``/proc/<pid>/environ``, ``ps e``): its preloader's,
    with ``BERTH_MODEL`` ending in ``-spare``, the mark kept (it goes with
    the preloader). Returns where the mark now lies in the block."""
    env = {k: v for k, v in os.environ.items() if k != SPACE}
    model = env.get("BERTH_MODEL")
    if model is None:
        return mark
    env["BERTH_MODEL"] = model + "-spare"
    os.environ.clear()
    rewritten = rewrite_environ(env)
    os.environ.update(env)
    if not rewritten:
        return mark
    return mark_in_block(), mark[1]
