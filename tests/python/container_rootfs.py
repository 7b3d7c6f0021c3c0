"""Writes a small root filesystem as a tar, for the container tests' image
(`podman import`; no image registry is reachable from the test machines):
this Python interpreter, its standard library (without its tests, IDLE,
Tk and site-packages), the shared libraries they link, and the fake
server (`fake_upstream.py`) at /fake_upstream.py.

    container_rootfs.py OUT.tar
"""

import glob
import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import tempfile

SKIP = shutil.ignore_patterns(
    "__pycache__", "site-packages", "test", "tests", "idlelib", "tkinter",
    "turtledemo", "ensurepip", "lib2to3", "config-*", "pydoc_data",
)


def main(out):
    exe = os.path.realpath(sys.executable)
    stdlib = sysconfig.get_paths()["stdlib"]
    here = os.path.dirname(os.path.abspath(__file__))
    with tempfile.TemporaryDirectory() as root:
        def copy(src):
            dst = root + src
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            if os.path.isdir(src):
                shutil.copytree(src, dst, ignore=SKIP, dirs_exist_ok=True)
            else:
                shutil.copy2(src, dst)

        copy(exe)
        copy(stdlib)
        libs = set()
        for binary in [exe] + glob.glob(stdlib + "/lib-dynload/*.so"):
            out_ = subprocess.run(["ldd", binary], capture_output=True, text=True).stdout
            libs.update(w for w in out_.split() if w.startswith("/"))
        for lib in sorted(libs):
            real = os.path.realpath(lib)
            copy(real)
            if real != lib and not os.path.lexists(root + lib):
                os.makedirs(os.path.dirname(root + lib), exist_ok=True)
                os.symlink(real, root + lib)
        for folder in ("tmp", "usr/local/bin", "etc"):
            os.makedirs(os.path.join(root, folder), exist_ok=True)
        os.symlink(exe, os.path.join(root, "usr/local/bin/python3"))
        shutil.copy2(os.path.join(here, "fake_upstream.py"), os.path.join(root, "fake_upstream.py"))
        with tarfile.open(out, "w") as tar:
            tar.add(root, arcname=".")


if __name__ == "__main__":
    main(sys.argv[1])
