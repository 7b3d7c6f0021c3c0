"""The GPU as the measuring script sees it, through the driver's own
libraries with ctypes (no pynvml, no framework): NVML's memory and
process readings, a bare process that holds device memory (the device's
own floor for giving memory back), and the machine's description.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import time
from typing import Dict, List, Optional, Tuple

MIB = 1 << 20


class _Memory(ctypes.Structure):
    _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong), ("used", ctypes.c_ulonglong)]


class _Process(ctypes.Structure):
    _fields_ = [
        ("pid", ctypes.c_uint),
        ("used", ctypes.c_ulonglong),
        ("gpu_instance", ctypes.c_uint),
        ("compute_instance", ctypes.c_uint),
    ]


class Nvml:
    """NVML, loaded once."""

    def __init__(self) -> None:
        self.lib = ctypes.CDLL("libnvidia-ml.so.1")
        if self.lib.nvmlInit_v2() != 0:
            raise RuntimeError("nvmlInit failed")

    def _device(self, index: int) -> ctypes.c_void_p:
        handle = ctypes.c_void_p()
        if self.lib.nvmlDeviceGetHandleByIndex_v2(index, ctypes.byref(handle)) != 0:
            raise RuntimeError("no GPU {}".format(index))
        return handle

    def memory(self, index: int = 0) -> Tuple[int, int]:
        """(used, total) bytes of device `index`."""
        m = _Memory()
        self.lib.nvmlDeviceGetMemoryInfo(self._device(index), ctypes.byref(m))
        return m.used, m.total

    def processes(self, index: int = 0) -> Dict[int, int]:
        """pid -> bytes of the compute processes on device `index`."""
        count = ctypes.c_uint(64)
        infos = (_Process * 64)()
        self.lib.nvmlDeviceGetComputeRunningProcesses_v3(self._device(index), ctypes.byref(count), infos)
        return {infos[i].pid: infos[i].used for i in range(count.value)}

    def held_by(self, pids: List[int], index: int = 0) -> int:
        procs = self.processes(index)
        return sum(procs.get(p, 0) for p in pids)


# A CUDA context on device 0 and sys.argv[1] bytes allocated in it, with
# the driver API alone (no framework).
ALLOCATE = r"""
import ctypes, sys, time
cuda = ctypes.CDLL("libcuda.so.1")
assert cuda.cuInit(0) == 0
dev, ctx, ptr = ctypes.c_int(), ctypes.c_void_p(), ctypes.c_ulonglong()
assert cuda.cuDeviceGet(ctypes.byref(dev), 0) == 0
assert cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev) == 0
assert cuda.cuCtxSetCurrent(ctx) == 0
assert cuda.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(int(sys.argv[1]))) == 0
"""

HOLDER = ALLOCATE + r"""
print("ready", flush=True)
time.sleep(3600)
"""


def bare_kill(nvml: Nvml, nbytes: int) -> Dict[str, float]:
    """A process holding `nbytes` of device memory (CUDA's driver API, no
    framework), SIGKILLed: how long until NVML no longer lists it and the
    device's used memory is back. The floor any supervisor's unload has."""
    before, _ = nvml.memory()
    child = subprocess.Popen([sys.executable, "-c", HOLDER, str(nbytes)], stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None
    if child.stdout.readline().strip() != "ready":
        child.kill()
        raise RuntimeError("the holder could not allocate")
    held = nvml.held_by([child.pid])
    loaded, _ = nvml.memory()
    started = time.monotonic()
    child.kill()
    gone_ms = back_ms = None
    while time.monotonic() - started < 10:
        elapsed = (time.monotonic() - started) * 1e3
        if gone_ms is None and child.pid not in nvml.processes():
            gone_ms = elapsed
        used, _ = nvml.memory()
        if back_ms is None and used - before < max(64 * MIB, (loaded - before) // 20):
            back_ms = elapsed
        if gone_ms is not None and back_ms is not None:
            break
        time.sleep(0.001)
    child.wait()
    return {"held_mib": held / MIB, "pid_gone_ms": gone_ms or -1.0, "memory_back_ms": back_ms or -1.0}


POOL = ALLOCATE + r"""
print("loaded", flush=True); sys.stdin.readline()
print("pooled", flush=True); sys.stdin.readline()
assert cuda.cuMemFree_v2(ptr) == 0
print("freed", flush=True); sys.stdin.readline()
"""


def in_one_process(nvml: Nvml, nbytes: int) -> Dict[str, float]:
    """A model's memory in a process that keeps running, as a framework's
    does: loaded; "unloaded" with its blocks kept in a pool (a caching
    allocator); "unloaded" with its blocks freed and the CUDA context
    alive. What NVML counts against the process at each step, in MiB."""
    child = subprocess.Popen([sys.executable, "-c", POOL, str(nbytes)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    assert child.stdin is not None and child.stdout is not None
    out: Dict[str, float] = {}
    try:
        for step in ("loaded", "pooled", "freed"):
            if child.stdout.readline().strip() != step:
                raise RuntimeError("the in-process holder failed at `{}`".format(step))
            time.sleep(0.2)
            out[step + "_mib"] = nvml.held_by([child.pid]) / MIB
            child.stdin.write("\n")
            child.stdin.flush()
    finally:
        child.kill()
        child.wait()
    return out


def describe() -> Dict[str, str]:
    """The GPU, its driver and CUDA version, as nvidia-smi says."""
    out: Dict[str, str] = {}
    try:
        line = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=30,
        ).stdout.splitlines()[0]
        name, driver, memory = [p.strip() for p in line.split(",")]
        out.update(gpu=name, driver=driver, memory=memory)
        smi = subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=30).stdout
        for part in smi.split("|"):
            if "CUDA Version" in part:
                out["cuda"] = part.split("CUDA Version:")[1].strip()
    except (OSError, IndexError, ValueError, subprocess.TimeoutExpired) as e:
        out["gpu"] = "unknown ({})".format(e)
    return out


def nvidia_lib_dirs(python: str) -> List[str]:
    """Folders of CUDA's libraries in `python`'s site-packages (PyTorch's
    CUDA wheels: `nvidia/cu13/lib`, or `nvidia/<lib>/lib` for CUDA 12)."""
    code = (
        "import nvidia, os, glob\n"
        "print('\\n'.join(d for p in nvidia.__path__ for d in sorted(glob.glob(os.path.join(p, '*', 'lib')))))"
    )
    try:
        out = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=60).stdout
    except OSError:
        return []
    return [d for d in out.splitlines() if os.path.isdir(d)]


def own_vram(nvml: Optional[Nvml]) -> float:
    """What NVML says this process holds, in MiB."""
    if nvml is None:
        return 0.0
    time.sleep(0.2)
    return nvml.held_by([os.getpid()]) / MIB
