"""Builds berth's worker with candle's CUDA kernels on a machine without a
CUDA toolkit (and without a GPU): nvcc and the CUDA libraries come from the
Python package index, by name, into a virtual environment of this build's
own, at the version the target machine's driver accepts.

    python3 deploy/cuda/build_worker.py --cuda 13.0            # the driver's CUDA version
    python3 deploy/cuda/build_worker.py --cuda 12.8 --arch 90  # machine code for H100s only
    python3 deploy/cuda/build_worker.py --cuda 13.0 --plan     # say what it would do, do nothing

`--cuda` is the CUDA version the driver reports (`nvidia-smi`'s "CUDA
Version"); without it, `nvidia-smi` is asked. The toolkit is never newer
than that: a driver rejects PTX from a newer compiler ("Unsupported
.version 9.5; current version is '9.0'", seen with a CUDA 13.0 driver and a
13.5 nvvm). The result, `target/cuda/berth-worker-cuda` (or `--out`), is
the `berth-worker` binary with the `cuda` feature:

- candle's kernels as machine code for each `--arch` (default 80, 86, 89,
  90: A100, A10/A40/RTX 30, L4/L40/RTX 40, H100/H200) and as PTX for newer
  GPUs, so no load or request waits for the driver's compiler on those
  GPUs (a fresh H100 took 17.7 s over the first request when every kernel
  was PTX);
- linked against libcuda (the driver) through a stub made here, and
  against libcudart, cuBLAS, cuBLASLt, cuRAND and NVRTC, which it finds at
  run time on `LD_LIBRARY_PATH`: the wheels this installed, PyTorch's CUDA
  wheels (`site-packages/nvidia/cu13/lib`) or a toolkit. It says which
  folder holds them.

It runs `cargo` with the toolkit's variables set and a target folder of its
own (`target/cuda/`), so the CPU build in `target/release` is untouched.
Standard library only: it runs with any python3.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import venv
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

ROOT = Path(__file__).resolve().parents[2]

#: CUDA versions the cudarc bindings of this build know, by major version:
#: the toolkit is one of these, the newest not newer than the driver.
SUPPORTED: Dict[int, Tuple[int, int]] = {12: (4, 9), 13: (0, 4)}
#: GPU architectures that get machine code by default: Ampere (A100: 80,
#: A10/A40/RTX 30: 86), Ada (L4/L40/RTX 40: 89), Hopper (H100/H200: 90).
DEFAULT_ARCHS = (80, 86, 89, 90)
#: candle's kernels that are loaded as modules (the others are linked in).
MODULES = (
    "affine",
    "binary",
    "cast",
    "conv",
    "fill",
    "indexing",
    "quantized",
    "reduce",
    "sort",
    "ternary",
    "unary",
)
#: What candle's own build passes nvcc (candle-kernels' build.rs).
CANDLE_NVCC_FLAGS = ("--expt-relaxed-constexpr", "-std=c++17", "-O3")


class Refused(Exception):
    """What cannot be built, and what to do instead."""


def parse_version(text: str) -> Tuple[int, int]:
    m = re.fullmatch(r"\s*(\d+)\.(\d+)(?:\.\d+)?\s*", text)
    if not m:
        raise Refused("`{}` is not a CUDA version such as 13.0 or 12.8".format(text))
    return int(m.group(1)), int(m.group(2))


def toolkit_for(driver: Tuple[int, int]) -> Tuple[int, int]:
    """The toolkit to build with for a driver of CUDA `driver`: the newest
    supported one that is not newer (a newer driver runs older PTX)."""
    major, minor = driver
    oldest = min(SUPPORTED)
    if major < oldest or (major == oldest and minor < SUPPORTED[oldest][0]):
        raise Refused(
            "the driver's CUDA {}.{} is older than CUDA {}.{}, the oldest this build of berth's "
            "CUDA worker supports; update the NVIDIA driver".format(
                major, minor, oldest, SUPPORTED[oldest][0]
            )
        )
    if major > max(SUPPORTED):
        major = max(SUPPORTED)
        minor = SUPPORTED[major][1]
    return major, min(minor, SUPPORTED[major][1])


def packages(toolkit: Tuple[int, int]) -> List[str]:
    """The wheels that make up the toolkit, pinned to its version. The
    compiler's parts (nvcc, nvvm, the C runtime headers) must be exactly
    this version; the libraries the worker links are pinned to it too,
    which every driver of this CUDA version runs."""
    major, minor = toolkit
    v = "=={}.{}.*".format(major, minor)
    if major == 13:
        names = ["nvidia-cuda-nvcc", "nvidia-cuda-crt", "nvidia-nvvm", "nvidia-cuda-runtime",
                 "nvidia-cuda-nvrtc", "nvidia-cuda-cccl", "nvidia-cublas"]
        return [name + v for name in names] + ["nvidia-curand==10.4.{}.*".format(minor)]
    names = ["nvidia-cuda-nvcc-cu12", "nvidia-cuda-runtime-cu12", "nvidia-cuda-nvrtc-cu12",
             "nvidia-cuda-cccl-cu12", "nvidia-cublas-cu12"]
    return [name + v for name in names] + ["nvidia-curand-cu12==10.3.*"]


def gencode(archs: Sequence[int]) -> List[str]:
    """nvcc's -gencode for machine code on each of `archs`, and PTX of the
    newest for GPUs after it."""
    out = ["-gencode=arch=compute_{0},code=sm_{0}".format(a) for a in sorted(archs)]
    newest = max(archs)
    out.append("-gencode=arch=compute_{0},code=compute_{0}".format(newest))
    return out


def parse_archs(text: str) -> List[int]:
    archs = []
    for part in text.split(","):
        part = part.strip().removeprefix("sm_")
        if not part.isdigit() or int(part) < 80:
            raise Refused(
                "`{}` is not a GPU architecture berth's CUDA worker builds for: give compute "
                "capabilities of 80 or more, as 80,86,89,90 (candle's kernels need 8.0)".format(part)
            )
        archs.append(int(part))
    return sorted(set(archs))


def driver_cuda() -> Optional[str]:
    """The CUDA version `nvidia-smi` reports, if there is one."""
    try:
        out = subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    m = re.search(r"CUDA Version:\s*(\d+\.\d+)", out)
    return m.group(1) if m else None


# ---- the toolkit, assembled from wheels --------------------------------


def make_venv(where: Path, wanted: List[str]) -> Path:
    """A virtual environment holding `wanted`, reused while they are the
    same; its `site-packages/nvidia` folder."""
    stamp = where / "berth-packages.json"
    python = where / "bin" / "python3"
    if not (stamp.is_file() and json.loads(stamp.read_text()) == wanted and python.exists()):
        if where.exists():
            shutil.rmtree(where)
        venv.EnvBuilder(with_pip=True).create(where)
        run([str(python), "-m", "pip", "install", "--quiet", "--no-deps", *wanted])
        stamp.write_text(json.dumps(wanted))
    found = list(where.glob("lib/python3*/site-packages/nvidia"))
    if not found:
        raise Refused("pip installed no `nvidia` packages into {}".format(where))
    return found[0]


def assemble(nvidia: Path, root: Path) -> None:
    """One toolkit folder (bin, include, lib, nvvm) from the wheels'
    folders: CUDA 13's wheels share one (`nvidia/cu13`), CUDA 12's have one
    each. The programs are copied, so nvcc finds the rest beside itself;
    the rest is linked."""
    nvidia = nvidia.resolve()
    if root.exists():
        shutil.rmtree(root)
    for sub in ("bin", "include", "lib"):
        (root / sub).mkdir(parents=True)
    for prefix in sorted(p for p in nvidia.iterdir() if p.is_dir()):
        for binary in sorted((prefix / "bin").glob("*")) if (prefix / "bin").is_dir() else []:
            target = root / "bin" / binary.name
            if target.exists():
                continue
            if binary.is_dir():
                shutil.copytree(binary, target)
            else:
                shutil.copy2(binary, target)
        for sub in ("include", "lib"):
            if not (prefix / sub).is_dir():
                continue
            for entry in sorted((prefix / sub).iterdir()):
                target = root / sub / entry.name
                if not target.exists():
                    target.symlink_to(entry)
        if (prefix / "nvvm").is_dir() and not (root / "nvvm").exists():
            (root / "nvvm").symlink_to(prefix / "nvvm")
    if not (root / "bin" / "nvcc").exists() or not (root / "nvvm").exists():
        raise Refused("the wheels under {} hold no nvcc or nvvm".format(nvidia))
    (root / "lib64").symlink_to("lib")
    # The linker looks for libX.so; the wheels ship libX.so.N.
    for lib in sorted((root / "lib").glob("lib*.so.*")):
        plain = root / "lib" / (lib.name.split(".so")[0] + ".so")
        if not plain.exists():
            plain.symlink_to(lib.name)


def stub_libcuda(root: Path, sys_rs: Path) -> Path:
    """A libcuda.so for the link only (soname libcuda.so.1, every driver
    function cudarc's bindings name): the driver's own is loaded at run
    time. Its folder."""
    names = sorted(set(re.findall(r"^pub unsafe fn (cu[A-Za-z0-9_]+)\(", sys_rs.read_text(), re.M)))
    if not names:
        raise Refused("found no driver functions in {}".format(sys_rs))
    stubs = root / "lib" / "stubs"
    stubs.mkdir(parents=True, exist_ok=True)
    source = stubs / "libcuda.c"
    source.write_text(
        "/* For linking only: the NVIDIA driver's libcuda.so.1 is loaded at run time. */\n"
        + "".join("int {}(void) {{ return 999; }}\n".format(n) for n in names)
    )
    run(["cc", "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o", str(stubs / "libcuda.so"),
         str(source)])
    return stubs


def nvcc_wrapper(root: Path, archs: Sequence[int]) -> None:
    """candle compiles its linked kernels for one architecture
    (CUDA_COMPUTE_CAP): the wrapper compiles them for each of `archs`."""
    real = root / "bin" / "nvcc.real"
    (root / "bin" / "nvcc").rename(real)
    codes = " ".join("'{}'".format(g) for g in gencode(archs))
    wrapper = root / "bin" / "nvcc"
    wrapper.write_text(
        "#!/bin/sh\n"
        "# berth: object files (candle's linked kernels) for every architecture; the rest as asked.\n"
        'case " $* " in\n'
        '  *" -c "*)\n'
        '    for a in "$@"; do shift; case "$a" in -gencode=*) ;; *) set -- "$@" "$a";; esac; done\n'
        '    exec "{real}" {codes} "$@";;\n'
        '  *) exec "{real}" "$@";;\n'
        "esac\n".format(real=real, codes=codes)
    )
    wrapper.chmod(0o755)


def fatbins(root: Path, kernels_src: Path, archs: Sequence[int], out: Path) -> Path:
    """candle's module kernels (the ones it loads from PTX text) as fat
    binaries: machine code for `archs`, PTX for newer GPUs. The worker's
    loader hands the driver these in place of the PTX."""
    out.mkdir(parents=True, exist_ok=True)
    for name in MODULES:
        source = kernels_src / "src" / (name + ".cu")
        if not source.is_file():
            raise Refused("candle's kernel source {} is missing".format(source))
        run([str(root / "bin" / "nvcc.real"), "-fatbin", *gencode(archs), *CANDLE_NVCC_FLAGS,
             "-o", str(out / (name + ".fatbin")), str(source)])
    return out


# ---- the build ----------------------------------------------------------


def run(argv: List[str], env: Optional[Dict[str, str]] = None, cwd: Optional[Path] = None) -> None:
    print("+ " + " ".join(argv), flush=True)
    subprocess.run(argv, check=True, env=env, cwd=cwd)


def crate_dir(name: str, version: str) -> Path:
    """Where cargo keeps a dependency's source (fetching it first)."""
    run(["cargo", "fetch", "--manifest-path", str(ROOT / "Cargo.toml")])
    meta = json.loads(subprocess.run(
        ["cargo", "metadata", "--format-version", "1", "--all-features", "--manifest-path",
         str(ROOT / "Cargo.toml")], check=True, capture_output=True, text=True).stdout)
    for package in meta["packages"]:
        if package["name"] == name and package["version"] == version:
            return Path(package["manifest_path"]).parent
    raise Refused("cargo knows no {} {}".format(name, version))


def locked_version(name: str) -> str:
    text = (ROOT / "Cargo.lock").read_text()
    m = re.search(r'name = "{}"\nversion = "([^"]+)"'.format(re.escape(name)), text)
    if not m:
        raise Refused("Cargo.lock has no {}".format(name))
    return m.group(1)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cuda", help="the CUDA version the target's driver reports (13.0)")
    parser.add_argument("--arch", default=",".join(map(str, DEFAULT_ARCHS)),
                        help="compute capabilities to build machine code for (80,86,89,90)")
    parser.add_argument("--out", default=str(ROOT / "target" / "cuda" / "berth-worker-cuda"))
    parser.add_argument("--plan", action="store_true", help="print the plan as JSON and stop")
    args = parser.parse_args(argv)
    try:
        cuda = args.cuda or driver_cuda()
        if cuda is None:
            raise Refused("no --cuda given and no nvidia-smi here to ask: give the CUDA version "
                          "the target machine's driver reports (`nvidia-smi`), as --cuda 13.0")
        toolkit = toolkit_for(parse_version(cuda))
        archs = parse_archs(args.arch)
        plan = {
            "driver_cuda": cuda,
            "toolkit": "{}.{}".format(*toolkit),
            "packages": packages(toolkit),
            "archs": archs,
            "gencode": gencode(archs),
            "out": args.out,
        }
        if args.plan:
            print(json.dumps(plan, indent=2))
            return 0
        build(plan, toolkit, archs, Path(args.out))
    except Refused as e:
        print("build_worker: " + str(e), file=sys.stderr)
        return 2
    return 0


def build(plan: Dict, toolkit: Tuple[int, int], archs: List[int], out: Path) -> None:
    work = ROOT / "target" / "cuda"
    tag = "{}.{}".format(*toolkit)
    nvidia = make_venv(work / ("toolkit-venv-" + tag), plan["packages"])
    root = work / ("toolkit-" + tag)
    assemble(nvidia, root)
    sys_rs = crate_dir("cudarc", locked_version("cudarc")) / "src" / "driver" / "sys" / "mod.rs"
    stubs = stub_libcuda(root, sys_rs)
    nvcc_wrapper(root, archs)
    kernels = fatbins(root, crate_dir("candle-kernels", locked_version("candle-kernels")), archs,
                      work / ("kernels-" + tag + "-" + "-".join(map(str, archs))))
    env = dict(os.environ)
    env.update({
        "CUDA_HOME": str(root),
        "CUDA_PATH": str(root),
        "NVCC": str(root / "bin" / "nvcc"),
        "PATH": "{}:{}".format(root / "bin", env.get("PATH", "")),
        # candle's PTX is for the oldest architecture: it runs on all of them.
        "CUDA_COMPUTE_CAP": str(min(archs)),
        "LIBRARY_PATH": "{}:{}".format(root / "lib", stubs),
        "RUSTFLAGS": (env.get("RUSTFLAGS", "") + " -L native={} -L native={}".format(
            root / "lib", stubs)).strip(),
        "BERTH_CUDA_FATBINS": str(kernels),
    })
    run(["cargo", "build", "--release", "-p", "berth-worker", "--features", "cuda",
         "--target-dir", str(work / "target")], env=env, cwd=ROOT)
    out.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(work / "target" / "release" / "berth-worker", out)
    digest = hashlib.sha256(out.read_bytes()).hexdigest()[:16]
    libs = root / "lib"
    print(
        "\nbuilt {out} (sha256 {digest}…) for CUDA {tag} drivers, machine code for sm_{archs}.\n"
        "At run time it needs libcudart, libcublas, libcublasLt, libcurand and libnvrtc of CUDA "
        "{major}: these wheels' folder is\n  {libs}\n(PyTorch's CUDA wheels carry the same in "
        "site-packages/nvidia/cu{major}/lib). Check the link with\n"
        "  LD_LIBRARY_PATH={libs} ldd {out} | grep 'not found'   # only libcuda.so.1, the "
        "driver's, on a machine without one\n".format(
            out=out, digest=digest, tag=tag, archs=", sm_".join(map(str, archs)),
            major=toolkit[0], libs=libs.resolve())
    )


if __name__ == "__main__":
    sys.exit(main())
