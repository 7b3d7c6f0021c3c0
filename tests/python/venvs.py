"""Builds the tests' Python virtual environments: the one place that knows
what each is made from (VENVS, below).

    python3 tests/python/venvs.py --target-dir DIR NAME [NAME ...]

makes each named venv under DIR (the cargo target dir's profile dir,
`target/release`) unless it is up to date, and prints its `python3`, one
line per name. The tests call it (tests/src/python.rs) for each venv they
use; `.ci/run` starts it in the background as CI begins, so the downloads
(PyTorch's wheel with its CUDA libraries is ~5 GB) run while cargo compiles.

A venv is remade only when what it is made from changes: its stamp
DIR/NAME/.berth-requirements holds a digest of its requirement files (their
paths and contents) and its build environment; `.berth-package` one of the
`berth_worker` package's files, reinstalled alone when they change. An
exclusive flock on DIR/NAME.lock is held while a venv is checked and built,
so of the processes that ask at once the first builds and the rest wait,
then find it up to date.

The standard library only (python3 >= 3.9 with venv and pip): a fresh
machine has nothing else.
"""

import argparse
import fcntl
import os
import shutil
import subprocess
import sys

# Name -> (requirement files, relative to the repo root; whether the
# berth_worker package from python/ is installed; pip's build environment).
VENVS = {
    # The standard library, numpy, and berth_worker: the Python workers'
    # tests.
    "python-test-venv": (["python/requirements-test.txt"], True, {}),
    # The Python models' tests: the frameworks pinned in
    # python/examples/requirements.txt (PyTorch, JAX, Equinox, safetensors,
    # tokenizers, the OpenAI client).
    "python-examples-venv": (
        ["python/requirements-test.txt", "python/examples/requirements.txt"],
        True,
        {},
    ),
    # The ONNX Runtime bench: the examples' (PyTorch, to export the model)
    # and onnx, onnxruntime.
    "python-onnx-venv": (
        [
            "python/requirements-test.txt",
            "python/examples/requirements.txt",
            "tests/python/requirements-onnx.txt",
        ],
        True,
        {},
    ),
    # The deployment checks: the Kubernetes schema validator and a
    # Containerfile parser.
    "python-deploy-venv": (["deploy/requirements.txt"], False, {}),
    # llama.cpp's server (llama-cpp-python, built from source by pip). Built
    # for any x86-64 CPU (GGML_NATIVE=OFF): built for the machine's own
    # (AVX-512 and AMX on an Intel Xeon VM here), its server died of SIGSEGV
    # at its first request. Without its multimodal library (LLAVA_BUILD=OFF:
    # the tests serve text models, and llama-cpp-python loads it only for an
    # image chat handler), which is a large part of the build's time.
    "python-llamacpp-venv": (
        ["tests/python/requirements-llamacpp.txt"],
        False,
        {"CMAKE_ARGS": "-DGGML_NATIVE=OFF -DLLAVA_BUILD=OFF"},
    ),
    # infinity-emb, the batching bench's embedding server (~6 GB with
    # PyTorch's CUDA libraries).
    "python-infinity-venv": (["tests/python/requirements-infinity.txt"], False, {}),
}

# The repository's root (this file is tests/python/venvs.py). Not resolved
# through links: the digest covers the files' paths, and the tests name
# this script under the root cargo gives them.
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class Failed(Exception):
    """A step of a venv's build failed; the message says which and why."""


def digest(files):
    """FNV-1a (64-bit) over each file's path, then its contents (empty if
    it cannot be read); only change matters. The same as the Rust tests'
    `python::digest`, so stamps written by either agree."""
    h = 0xCBF29CE484222325
    for path in files:
        try:
            with open(path, "rb") as f:
                content = f.read()
        except OSError:
            content = b""
        # Rust's `to_string_lossy`: the path's bytes, invalid UTF-8 replaced.
        name = os.fsencode(path).decode("utf-8", "replace").encode("utf-8")
        for b in name + content:
            h ^= b
            h = (h * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return "%016x" % h


def files_under(directory, out):
    """The .py and .toml files under `directory`, each directory's entries
    in order of name, leaving out __pycache__."""
    try:
        names = os.listdir(directory)
    except OSError:
        return
    for name in sorted(names, key=os.fsencode):
        path = os.path.join(directory, name)
        if os.path.isdir(path):
            if name != "__pycache__":
                files_under(path, out)
        elif os.path.splitext(name)[1] in (".py", ".toml"):
            out.append(path)


def read(path):
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        return None


def run(what, command, cwd=None, env=None):
    """Runs `command`, its output kept; raises Failed with that output if it
    fails."""
    try:
        out = subprocess.run(command, env=env, cwd=cwd, capture_output=True)
    except OSError as e:
        raise Failed("%s: cannot run %s: %s" % (what, command, e))
    if out.returncode != 0:
        raise Failed(
            "%s failed (exit status %d): %s\n%s\n%s"
            % (
                what,
                out.returncode,
                " ".join(command),
                out.stdout.decode(errors="replace"),
                out.stderr.decode(errors="replace"),
            )
        )


def build(target, name):
    """Makes `name` under `target` unless it is up to date; returns its
    python3."""
    requirements, package, build_env = VENVS[name]
    directory = os.path.join(target, name)
    python = os.path.join(directory, "bin", "python3")
    with open(os.path.join(target, name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        req_files = [os.path.join(ROOT, r) for r in requirements]
        # The build's environment is part of what the venv is made from.
        req_stamp = digest(req_files) + "".join(
            " %s=%s" % (k, v) for k, v in build_env.items()
        )
        stamp_file = os.path.join(directory, ".berth-requirements")
        if read(stamp_file) != req_stamp.encode():
            shutil.rmtree(directory, ignore_errors=True)
            # Run from `target`: `-m venv` run from this file's folder would
            # find this file before the standard library's venv.
            run("creating the venv", [sys.executable, "-m", "venv", directory], target)
            # pip's cache would keep a second copy of every wheel (PyTorch's
            # CUDA libraries are ~4 GB) and buffer each download twice in the
            # temporary directory, which may be a small tmpfs: no cache, and
            # temporaries beside the venv, on the disk that holds target/.
            tmp = os.path.join(target, name + ".tmp")
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)
            env = dict(os.environ, TMPDIR=tmp, **build_env)
            pip = [python, "-m", "pip", "install", "--disable-pip-version-check", "-q"]
            pip.append("--no-cache-dir")
            for file in req_files:
                pip += ["-r", file]
            try:
                run("installing the requirements", pip, env=env)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
            with open(stamp_file, "wb") as f:
                f.write(req_stamp.encode())
        if package:
            files = [os.path.join(ROOT, "python", "pyproject.toml")]
            files_under(os.path.join(ROOT, "python", "berth_worker"), files)
            pkg_stamp = digest(files)
            pkg_file = os.path.join(directory, ".berth-package")
            if read(pkg_file) != pkg_stamp.encode():
                run(
                    "installing ./python",
                    [python, "-m", "pip", "install", "--disable-pip-version-check", "-q"]
                    + ["--no-deps", "--no-build-isolation", "--force-reinstall"]
                    + [os.path.join(ROOT, "python")],
                )
                with open(pkg_file, "wb") as f:
                    f.write(pkg_stamp.encode())
    return python


def main():
    parser = argparse.ArgumentParser(
        description="Build the tests' Python venvs (if needed) and print their python3."
    )
    parser.add_argument(
        "--target-dir",
        required=True,
        help="where the venvs lie: the cargo target dir's profile dir (target/release)",
    )
    parser.add_argument("names", nargs="+", metavar="NAME", choices=sorted(VENVS))
    args = parser.parse_args()
    target = os.path.abspath(args.target_dir)
    os.makedirs(target, exist_ok=True)
    failed = []
    for name in args.names:
        try:
            print(build(target, name), flush=True)
        except (Failed, OSError) as e:
            print("venv %s: %s" % (name, e), file=sys.stderr, flush=True)
            failed.append(name)
    if failed:
        sys.exit("venvs.py: could not build %s" % ", ".join(failed))


if __name__ == "__main__":
    main()
