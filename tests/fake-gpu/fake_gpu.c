/*
 * fake_gpu.c: a stand-in for the NVIDIA management library (libnvidia-ml.so.1)
 * and the CUDA driver (libcuda.so / libcuda.so.1) in one shared object, so
 * that berth's GPU code paths (NVML readings in the supervisor, cudarc in
 * the gpu-hog worker) can run end to end on a machine without a GPU.
 *
 * Build:  gcc -std=c11 -shared -fPIC -O2 -Wall -Wextra -Werror \
 *             -o libfake_gpu.so fake_gpu.c -ldl -lpthread
 * Use:    symlink the .so as libnvidia-ml.so.1, libnvidia-ml.so, libcuda.so
 *         and libcuda.so.1 in one directory, put a `devices` file there and
 *         point LD_LIBRARY_PATH at it. See README.md beside this file.
 *
 * Model
 * -----
 * DIR is the directory the library was loaded from (the directory of the
 * path the dynamic loader used, i.e. of the symlink, which is not resolved),
 * found with dladdr(), so that processes started with an otherwise empty
 * environment still find it.
 *
 * DIR/devices describes the devices, one per line (blank lines and lines
 * starting with '#' are skipped); the device index is the line's position
 * among the device lines, from 0:
 *
 *     <name> <total_bytes> <base_used_bytes> <context_bytes> [<mempools>]
 *
 * The name has no spaces; '_' reads as a space ("NVIDIA_H100" is reported
 * as "NVIDIA H100"). Sizes are decimal bytes, optionally followed by K, M,
 * G or T (powers of 1024). context_bytes is what creating a CUDA context on
 * the device costs a process (around 500M on real GPUs). mempools (0 or 1,
 * default 1) is what CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED reports; all
 * real GPUs berth targets report 1, which makes cudarc allocate with
 * cuMemAllocAsync/cuMemFreeAsync; 0 makes it use cuMemAlloc_v2/cuMemFree_v2.
 * No devices file means no devices.
 *
 * DIR/state/<pid>.<index> holds, in decimal, the bytes process <pid> holds
 * on device <index>: context_bytes while it has a context there, plus its
 * live allocations. A CUDA process rewrites it (temp file + rename) on every
 * change and removes it when it holds nothing. NVML reads: a device's used
 * memory is its base_used plus the files of live processes for it; its
 * compute processes are those live processes. A process is live while
 * /proc/<pid>/stat exists and its state is neither Z nor X (a real driver
 * frees a process's memory when it exits, before it is reaped). Files of
 * dead processes are ignored, and removed when seen.
 *
 * CUDA ordinals follow CUDA_VISIBLE_DEVICES as read at cuInit: a comma
 * separated list of indices or UUIDs ("GPU-...", a unique prefix is enough);
 * unset means every device in index order; the list stops at the first
 * entry that matches no device (or repeats one), as CUDA's does.
 *
 * An allocation fails with CUDA_ERROR_OUT_OF_MEMORY when the device's used
 * memory (as NVML would report it, across all processes) plus the request
 * exceeds its total; so does creating the first context on a device when
 * context_bytes does not fit. Check and update happen under an flock on
 * DIR/state/.lock, so concurrent processes cannot overcommit. Device
 * pointers are made up and never dereferenced: memset and memcpy calls do
 * nothing (a copy to the host fills it with zeros), and no kernel runs.
 *
 * A child forked by a CUDA process starts with a clean driver state (no
 * contexts, no allocations, cuInit not called), so it can call cuInit and
 * allocate on its own account; a real driver refuses CUDA in such a child.
 * Its parent's allocations stay the parent's.
 *
 * Calls that mean nothing here (streams, events, synchronisation, flags)
 * succeed.
 */
#define _GNU_SOURCE
#include <ctype.h>
#include <dirent.h>
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

#define EXPORT __attribute__((visibility("default")))

/* ------------------------------------------------------------------------ */
/* Types and codes, as in cuda.h / nvml.h (and cudarc / nvml-wrapper-sys).   */
/* ------------------------------------------------------------------------ */

typedef int CUresult;
typedef int CUdevice; /* CUdevice_v1 = c_int: the ordinal */
typedef unsigned long long CUdeviceptr;
typedef struct fake_ctx *CUcontext;
typedef void *CUstream;
typedef void *CUevent;
typedef struct {
    char bytes[16];
} CUuuid;

enum {
    CUDA_SUCCESS = 0,
    CUDA_ERROR_INVALID_VALUE = 1,
    CUDA_ERROR_OUT_OF_MEMORY = 2,
    CUDA_ERROR_NOT_INITIALIZED = 3,
    CUDA_ERROR_NO_DEVICE = 100,
    CUDA_ERROR_INVALID_DEVICE = 101,
    CUDA_ERROR_INVALID_CONTEXT = 201,
    CUDA_ERROR_OPERATING_SYSTEM = 304,
    CUDA_ERROR_ILLEGAL_STATE = 401,
    CUDA_ERROR_NOT_SUPPORTED = 801,
    CUDA_ERROR_UNKNOWN = 999,
};

enum {
    CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK = 1,
    CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK = 8,
    CU_DEVICE_ATTRIBUTE_WARP_SIZE = 10,
    CU_DEVICE_ATTRIBUTE_CLOCK_RATE = 13,
    CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT = 16,
    CU_DEVICE_ATTRIBUTE_CONCURRENT_KERNELS = 31,
    CU_DEVICE_ATTRIBUTE_PCI_BUS_ID = 33,
    CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID = 34,
    CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH = 37,
    CU_DEVICE_ATTRIBUTE_ASYNC_ENGINE_COUNT = 40,
    CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING = 41,
    CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID = 50,
    CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR = 75,
    CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR = 76,
    CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED = 115,
};

typedef unsigned int nvmlReturn_t;
typedef struct nvml_handle *nvmlDevice_t;

enum {
    NVML_SUCCESS = 0,
    NVML_ERROR_UNINITIALIZED = 1,
    NVML_ERROR_INVALID_ARGUMENT = 2,
    NVML_ERROR_NOT_SUPPORTED = 3,
    NVML_ERROR_NOT_FOUND = 6,
    NVML_ERROR_INSUFFICIENT_SIZE = 7,
    NVML_ERROR_UNKNOWN = 999,
};

/* nvmlMemory_t */
typedef struct {
    unsigned long long total, free, used;
} nvmlMemory_t;

/* nvmlMemory_v2_t: version, then (after 4 bytes of padding) the sizes. */
typedef struct {
    unsigned int version;
    unsigned long long total, reserved, free, used;
} nvmlMemory_v2_t;

/* nvmlProcessInfo_v1_t: what nvmlDeviceGetComputeRunningProcesses fills. */
typedef struct {
    unsigned int pid;
    unsigned long long usedGpuMemory;
} nvmlProcessInfo_v1_t;

/* nvmlProcessInfo_t (= nvmlProcessInfo_v2_t): what the _v2 and _v3 calls
 * fill, 24 bytes. 0xFFFFFFFF instance ids mean "not a MIG instance". */
typedef struct {
    unsigned int pid;
    unsigned long long usedGpuMemory;
    unsigned int gpuInstanceId;
    unsigned int computeInstanceId;
} nvmlProcessInfo_t;

/* nvmlPciInfo_t, as filled by nvmlDeviceGetPciInfo_v2/_v3. */
typedef struct {
    char busIdLegacy[16];
    unsigned int domain, bus, device, pciDeviceId, pciSubSystemId;
    char busId[32];
} nvmlPciInfo_t;

typedef struct {
    unsigned int gpu, memory;
} nvmlUtilization_t;

#define FAKE_DRIVER_VERSION "580.65.06"
#define FAKE_NVML_VERSION "13.580.65.06"
#define FAKE_CUDA_VERSION 13000 /* 13.0 */

/* ------------------------------------------------------------------------ */
/* Where things live                                                         */
/* ------------------------------------------------------------------------ */

#define MAX_DEVICES 64
#define PATH_LEN (PATH_MAX + 64)

static pthread_once_t g_paths_once = PTHREAD_ONCE_INIT;
static char g_dir[PATH_MAX];   /* DIR */
static char g_state[PATH_LEN]; /* DIR/state */

static void find_paths(void)
{
    Dl_info info;
    char loaded[PATH_MAX] = ".";
    if (dladdr((void *)&find_paths, &info) != 0 && info.dli_fname != NULL &&
        strlen(info.dli_fname) < sizeof loaded) {
        strcpy(loaded, info.dli_fname);
    }
    char *slash = strrchr(loaded, '/');
    if (slash == NULL) {
        strcpy(loaded, ".");
    } else if (slash == loaded) {
        loaded[1] = '\0';
    } else {
        *slash = '\0';
    }
    /* Only the directory is made absolute: a symlinked library keeps the
     * directory of its link, where the devices file is. */
    if (realpath(loaded, g_dir) == NULL) {
        snprintf(g_dir, sizeof g_dir, "%s", loaded);
    }
    snprintf(g_state, sizeof g_state, "%s/state", g_dir);
}

static const char *dir_path(void)
{
    pthread_once(&g_paths_once, find_paths);
    return g_dir;
}

static const char *state_path(void)
{
    pthread_once(&g_paths_once, find_paths);
    return g_state;
}

/* Whether snprintf's result `n` fitted in `size` bytes. */
static bool fits(int n, size_t size) { return n >= 0 && (size_t)n < size; }

static bool ensure_state_dir(void)
{
    return mkdir(state_path(), 0777) == 0 || errno == EEXIST;
}

/* ------------------------------------------------------------------------ */
/* The devices file                                                          */
/* ------------------------------------------------------------------------ */

struct device {
    char name[96];
    unsigned long long total, base_used, context_bytes;
    int mempools;
};

/* A size: decimal, optionally followed by K, M, G or T. */
static bool parse_size(const char *s, unsigned long long *out)
{
    if (!isdigit((unsigned char)s[0]))
        return false;
    char *end;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 10);
    if (errno != 0)
        return false;
    int shift = 0;
    switch (*end) {
    case '\0': break;
    case 'K': case 'k': shift = 10; end++; break;
    case 'M': case 'm': shift = 20; end++; break;
    case 'G': case 'g': shift = 30; end++; break;
    case 'T': case 't': shift = 40; end++; break;
    default: return false;
    }
    if (*end != '\0' || (shift > 0 && v > (~0ULL >> shift)))
        return false;
    *out = v << shift;
    return true;
}

/* Reads DIR/devices into `devs` (MAX_DEVICES entries); returns the count. */
static int read_devices(struct device *devs)
{
    static bool warned;
    char path[PATH_LEN];
    snprintf(path, sizeof path, "%s/devices", dir_path());
    FILE *f = fopen(path, "re");
    if (f == NULL)
        return 0;
    int n = 0, lineno = 0;
    char line[512];
    while (n < MAX_DEVICES && fgets(line, sizeof line, f) != NULL) {
        lineno++;
        char *p = line;
        while (isspace((unsigned char)*p))
            p++;
        if (*p == '\0' || *p == '#')
            continue;
        char name[96], total[64], base[64], ctx[64], pools[16] = "1";
        int got = sscanf(p, "%95s %63s %63s %63s %15s", name, total, base, ctx, pools);
        struct device *d = &devs[n];
        if (got < 4 || !parse_size(total, &d->total) || !parse_size(base, &d->base_used) ||
            !parse_size(ctx, &d->context_bytes) || (strcmp(pools, "0") && strcmp(pools, "1"))) {
            if (!warned) {
                warned = true;
                fprintf(stderr, "fake_gpu: %s:%d: malformed device line skipped\n", path, lineno);
            }
            continue;
        }
        for (char *c = name; *c; c++)
            if (*c == '_')
                *c = ' ';
        snprintf(d->name, sizeof d->name, "%s", name);
        d->mempools = pools[0] == '1';
        n++;
    }
    fclose(f);
    return n;
}

static void device_uuid(int index, char *out, size_t len)
{
    snprintf(out, len, "GPU-fa4e0000-0000-0000-0000-%012x", (unsigned)index);
}

/* ------------------------------------------------------------------------ */
/* Reading the state directory (what NVML reports)                           */
/* ------------------------------------------------------------------------ */

/* Whether `pid` runs: /proc/<pid>/stat exists and its state is not Z/X. */
static bool pid_alive(long pid)
{
    char path[64], buf[512];
    snprintf(path, sizeof path, "/proc/%ld/stat", pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return false;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0)
        return false;
    buf[n] = '\0';
    /* "pid (comm) S ...": comm may hold spaces and parentheses. */
    char *paren = strrchr(buf, ')');
    if (paren == NULL || paren[1] != ' ')
        return false;
    char state = paren[2];
    return state != 'Z' && state != 'X' && state != 'x' && state != '\0';
}

/* Parses "<pid>.<index>"; false for anything else (temp files, the lock). */
static bool parse_state_name(const char *name, long *pid, int *index)
{
    const char *p = name;
    if (!isdigit((unsigned char)*p))
        return false;
    long v = 0;
    for (; isdigit((unsigned char)*p); p++) {
        v = v * 10 + (*p - '0');
        if (v > INT_MAX)
            return false;
    }
    if (*p++ != '.' || !isdigit((unsigned char)*p))
        return false;
    int i = 0;
    for (; isdigit((unsigned char)*p); p++) {
        i = i * 10 + (*p - '0');
        if (i >= MAX_DEVICES)
            return false;
    }
    if (*p != '\0')
        return false;
    *pid = v;
    *index = i;
    return true;
}

static bool read_bytes_file(const char *path, unsigned long long *out)
{
    char buf[64];
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return false;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0)
        return false;
    buf[n] = '\0';
    char *end;
    errno = 0;
    unsigned long long v = strtoull(buf, &end, 10);
    if (errno != 0 || end == buf)
        return false;
    *out = v;
    return true;
}

struct proc_usage {
    unsigned int pid;
    unsigned long long bytes;
};

static int by_pid(const void *a, const void *b)
{
    unsigned x = ((const struct proc_usage *)a)->pid, y = ((const struct proc_usage *)b)->pid;
    return (x > y) - (x < y);
}

/* The live processes on device `index`, sorted by pid, in *out (malloc'd,
 * may be NULL when none; the caller frees it); returns their number and
 * adds their bytes to *sum. Files of dead processes are removed. */
static size_t scan_device(int index, struct proc_usage **out, unsigned long long *sum)
{
    *out = NULL;
    DIR *dir = opendir(state_path());
    if (dir == NULL)
        return 0;
    size_t n = 0, cap = 0;
    struct dirent *e;
    while ((e = readdir(dir)) != NULL) {
        long pid;
        int i;
        if (!parse_state_name(e->d_name, &pid, &i) || i != index)
            continue;
        char path[PATH_LEN];
        if (!fits(snprintf(path, sizeof path, "%s/%s", state_path(), e->d_name), sizeof path))
            continue;
        if (!pid_alive(pid)) {
            unlink(path);
            continue;
        }
        unsigned long long bytes;
        if (!read_bytes_file(path, &bytes))
            continue; /* removed under us: the process just freed it all */
        if (n == cap) {
            cap = cap ? cap * 2 : 8;
            struct proc_usage *grown = realloc(*out, cap * sizeof **out);
            if (grown == NULL)
                break;
            *out = grown;
        }
        (*out)[n].pid = (unsigned)pid;
        (*out)[n].bytes = bytes;
        n++;
        *sum += bytes;
    }
    closedir(dir);
    if (n > 1)
        qsort(*out, n, sizeof **out, by_pid);
    return n;
}

/* Used memory of device `index` as NVML reports it. */
static unsigned long long device_used(int index, const struct device *d)
{
    struct proc_usage *procs;
    unsigned long long sum = 0;
    scan_device(index, &procs, &sum);
    free(procs);
    unsigned long long used = d->base_used + sum;
    return used < d->base_used ? ~0ULL : used; /* saturate */
}

/* ======================================================================== */
/* NVML                                                                      */
/* ======================================================================== */

/* Device handles point into this array; a handle's index is its offset. */
struct nvml_handle {
    char unused;
};
static struct nvml_handle g_nvml_handles[MAX_DEVICES];
static pthread_mutex_t g_nvml_mu = PTHREAD_MUTEX_INITIALIZER;
static int g_nvml_refs; /* nvmlInit calls not yet matched by nvmlShutdown */

static bool nvml_ready(void)
{
    pthread_mutex_lock(&g_nvml_mu);
    bool ready = g_nvml_refs > 0;
    pthread_mutex_unlock(&g_nvml_mu);
    return ready;
}

/* Resolves a handle to its index and its line of the devices file. */
static nvmlReturn_t nvml_device(nvmlDevice_t h, int *index, struct device *out)
{
    if (!nvml_ready())
        return NVML_ERROR_UNINITIALIZED;
    uintptr_t p = (uintptr_t)h, base = (uintptr_t)g_nvml_handles;
    if (p < base || p >= base + sizeof g_nvml_handles)
        return NVML_ERROR_INVALID_ARGUMENT;
    int i = (int)(p - base);
    struct device devs[MAX_DEVICES];
    if (i >= read_devices(devs))
        return NVML_ERROR_INVALID_ARGUMENT;
    *index = i;
    *out = devs[i];
    return NVML_SUCCESS;
}

static nvmlReturn_t copy_string(char *dst, unsigned int len, const char *src)
{
    if (dst == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (strlen(src) + 1 > len)
        return NVML_ERROR_INSUFFICIENT_SIZE;
    strcpy(dst, src);
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlInit_v2(void)
{
    pthread_mutex_lock(&g_nvml_mu);
    g_nvml_refs++;
    pthread_mutex_unlock(&g_nvml_mu);
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlInit(void) { return nvmlInit_v2(); }

EXPORT nvmlReturn_t nvmlInitWithFlags(unsigned int flags)
{
    (void)flags;
    return nvmlInit_v2();
}

EXPORT nvmlReturn_t nvmlShutdown(void)
{
    pthread_mutex_lock(&g_nvml_mu);
    nvmlReturn_t r = g_nvml_refs > 0 ? NVML_SUCCESS : NVML_ERROR_UNINITIALIZED;
    if (g_nvml_refs > 0)
        g_nvml_refs--;
    pthread_mutex_unlock(&g_nvml_mu);
    return r;
}

EXPORT const char *nvmlErrorString(nvmlReturn_t result)
{
    switch (result) {
    case 0: return "Success";
    case 1: return "Uninitialized";
    case 2: return "Invalid Argument";
    case 3: return "Not Supported";
    case 4: return "Insufficient Permissions";
    case 5: return "Already Initialized";
    case 6: return "Not Found";
    case 7: return "Insufficient Size";
    case 8: return "Insufficient External Power";
    case 9: return "Driver Not Loaded";
    case 10: return "Timeout";
    case 11: return "Interrupt request issue";
    case 12: return "NVML Shared Library Not Found";
    case 13: return "Function Not Found";
    case 14: return "Corrupted infoROM";
    case 15: return "GPU is lost";
    case 16: return "GPU requires restart";
    case 17: return "The operating system has blocked the request.";
    case 18: return "RM has detected an NVML/RM version mismatch.";
    case 19: return "In use by another client";
    case 20: return "Insufficient Memory";
    case 21: return "No data";
    default: return "Unknown Error";
    }
}

EXPORT nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length)
{
    return copy_string(version, length, FAKE_DRIVER_VERSION);
}

EXPORT nvmlReturn_t nvmlSystemGetNVMLVersion(char *version, unsigned int length)
{
    return copy_string(version, length, FAKE_NVML_VERSION);
}

EXPORT nvmlReturn_t nvmlSystemGetCudaDriverVersion(int *version)
{
    if (version == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    *version = FAKE_CUDA_VERSION;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlSystemGetCudaDriverVersion_v2(int *version)
{
    return nvmlSystemGetCudaDriverVersion(version);
}

EXPORT nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *count)
{
    if (!nvml_ready())
        return NVML_ERROR_UNINITIALIZED;
    if (count == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    struct device devs[MAX_DEVICES];
    *count = (unsigned)read_devices(devs);
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetCount(unsigned int *count) { return nvmlDeviceGetCount_v2(count); }

EXPORT nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device)
{
    if (!nvml_ready())
        return NVML_ERROR_UNINITIALIZED;
    struct device devs[MAX_DEVICES];
    if (device == NULL || index >= (unsigned)read_devices(devs))
        return NVML_ERROR_INVALID_ARGUMENT;
    *device = &g_nvml_handles[index];
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetHandleByIndex(unsigned int index, nvmlDevice_t *device)
{
    return nvmlDeviceGetHandleByIndex_v2(index, device);
}

EXPORT nvmlReturn_t nvmlDeviceGetHandleByUUID(const char *uuid, nvmlDevice_t *device)
{
    if (!nvml_ready())
        return NVML_ERROR_UNINITIALIZED;
    if (uuid == NULL || device == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    struct device devs[MAX_DEVICES];
    int n = read_devices(devs);
    for (int i = 0; i < n; i++) {
        char u[64];
        device_uuid(i, u, sizeof u);
        if (strcmp(u, uuid) == 0) {
            *device = &g_nvml_handles[i];
            return NVML_SUCCESS;
        }
    }
    return NVML_ERROR_NOT_FOUND;
}

EXPORT nvmlReturn_t nvmlDeviceGetIndex(nvmlDevice_t device, unsigned int *index)
{
    int i;
    struct device d;
    nvmlReturn_t r = nvml_device(device, &i, &d);
    if (r != NVML_SUCCESS)
        return r;
    if (index == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    *index = (unsigned)i;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetMinorNumber(nvmlDevice_t device, unsigned int *minor)
{
    return nvmlDeviceGetIndex(device, minor);
}

EXPORT nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t device, char *name, unsigned int length)
{
    int i;
    struct device d;
    nvmlReturn_t r = nvml_device(device, &i, &d);
    return r != NVML_SUCCESS ? r : copy_string(name, length, d.name);
}

EXPORT nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t device, char *uuid, unsigned int length)
{
    int i;
    struct device d;
    nvmlReturn_t r = nvml_device(device, &i, &d);
    if (r != NVML_SUCCESS)
        return r;
    char u[64];
    device_uuid(i, u, sizeof u);
    return copy_string(uuid, length, u);
}

/* Device i sits on bus 0x10 + i, as an H100 (10de:2330). */
static void fill_pci(int i, nvmlPciInfo_t *pci)
{
    memset(pci, 0, sizeof *pci);
    pci->domain = 0;
    pci->bus = 0x10 + (unsigned)i;
    pci->device = 0;
    pci->pciDeviceId = 0x233010DE;
    pci->pciSubSystemId = 0x16C110DE;
    snprintf(pci->busIdLegacy, sizeof pci->busIdLegacy, "0000:%02X:00.0", pci->bus);
    snprintf(pci->busId, sizeof pci->busId, "00000000:%02X:00.0", pci->bus);
}

EXPORT nvmlReturn_t nvmlDeviceGetPciInfo_v3(nvmlDevice_t device, nvmlPciInfo_t *pci)
{
    int i;
    struct device d;
    nvmlReturn_t r = nvml_device(device, &i, &d);
    if (r != NVML_SUCCESS)
        return r;
    if (pci == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    fill_pci(i, pci);
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetPciInfo_v2(nvmlDevice_t device, nvmlPciInfo_t *pci)
{
    return nvmlDeviceGetPciInfo_v3(device, pci);
}

EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t device, nvmlMemory_v2_t *memory)
{
    int i;
    struct device d;
    nvmlReturn_t r = nvml_device(device, &i, &d);
    if (r != NVML_SUCCESS)
        return r;
    if (memory == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    unsigned long long used = device_used(i, &d);
    memory->total = d.total;
    memory->reserved = 0;
    memory->used = used;
    memory->free = used >= d.total ? 0 : d.total - used;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory)
{
    if (memory == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    nvmlMemory_v2_t m;
    nvmlReturn_t r = nvmlDeviceGetMemoryInfo_v2(device, &m);
    if (r == NVML_SUCCESS) {
        memory->total = m.total;
        memory->free = m.free;
        memory->used = m.used;
    }
    return r;
}

/* The shared body of the running-process queries: with too small a count
 * (or no buffer) and processes to report, sets *count to their number and
 * answers NVML_ERROR_INSUFFICIENT_SIZE, as NVML does; `v1` picks the old
 * 16-byte nvmlProcessInfo_v1_t layout. */
static nvmlReturn_t compute_processes(nvmlDevice_t device, unsigned int *count, void *infos, bool v1)
{
    int i;
    struct device d;
    nvmlReturn_t r = nvml_device(device, &i, &d);
    if (r != NVML_SUCCESS)
        return r;
    if (count == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    struct proc_usage *procs;
    unsigned long long sum = 0;
    size_t n = scan_device(i, &procs, &sum);
    if (n == 0) {
        *count = 0;
    } else if (infos == NULL || *count < n) {
        *count = (unsigned)n;
        r = NVML_ERROR_INSUFFICIENT_SIZE;
    } else {
        for (size_t k = 0; k < n; k++) {
            if (v1) {
                nvmlProcessInfo_v1_t *p = (nvmlProcessInfo_v1_t *)infos + k;
                p->pid = procs[k].pid;
                p->usedGpuMemory = procs[k].bytes;
            } else {
                nvmlProcessInfo_t *p = (nvmlProcessInfo_t *)infos + k;
                p->pid = procs[k].pid;
                p->usedGpuMemory = procs[k].bytes;
                p->gpuInstanceId = 0xFFFFFFFFu;
                p->computeInstanceId = 0xFFFFFFFFu;
            }
        }
        *count = (unsigned)n;
    }
    free(procs);
    return r;
}

EXPORT nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t device, unsigned int *infoCount,
                                                            nvmlProcessInfo_t *infos)
{
    return compute_processes(device, infoCount, infos, false);
}

EXPORT nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v2(nvmlDevice_t device, unsigned int *infoCount,
                                                            nvmlProcessInfo_t *infos)
{
    return compute_processes(device, infoCount, infos, false);
}

EXPORT nvmlReturn_t nvmlDeviceGetComputeRunningProcesses(nvmlDevice_t device, unsigned int *infoCount,
                                                         nvmlProcessInfo_v1_t *infos)
{
    return compute_processes(device, infoCount, infos, true);
}

/* No graphics or MPS clients here. */
static nvmlReturn_t no_processes(nvmlDevice_t device, unsigned int *count)
{
    int i;
    struct device d;
    nvmlReturn_t r = nvml_device(device, &i, &d);
    if (r != NVML_SUCCESS)
        return r;
    if (count == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    *count = 0;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetGraphicsRunningProcesses_v3(nvmlDevice_t device, unsigned int *infoCount,
                                                             nvmlProcessInfo_t *infos)
{
    (void)infos;
    return no_processes(device, infoCount);
}

EXPORT nvmlReturn_t nvmlDeviceGetGraphicsRunningProcesses_v2(nvmlDevice_t device, unsigned int *infoCount,
                                                             nvmlProcessInfo_t *infos)
{
    (void)infos;
    return no_processes(device, infoCount);
}

EXPORT nvmlReturn_t nvmlDeviceGetMPSComputeRunningProcesses_v3(nvmlDevice_t device, unsigned int *infoCount,
                                                               nvmlProcessInfo_t *infos)
{
    (void)infos;
    return no_processes(device, infoCount);
}

EXPORT nvmlReturn_t nvmlDeviceGetCudaComputeCapability(nvmlDevice_t device, int *major, int *minor)
{
    int i;
    struct device d;
    nvmlReturn_t r = nvml_device(device, &i, &d);
    if (r != NVML_SUCCESS)
        return r;
    if (major == NULL || minor == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    *major = 9;
    *minor = 0;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetUtilizationRates(nvmlDevice_t device, nvmlUtilization_t *utilization)
{
    int i;
    struct device d;
    nvmlReturn_t r = nvml_device(device, &i, &d);
    if (r != NVML_SUCCESS)
        return r;
    if (utilization == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    utilization->gpu = 0;
    utilization->memory = 0;
    return NVML_SUCCESS;
}

/* ======================================================================== */
/* CUDA driver                                                               */
/* ======================================================================== */

/* A context. Primary contexts are one per device, fixed; contexts from
 * cuCtxCreate come from a fixed pool, so stale handles stay harmless. */
struct fake_ctx {
    int dev;      /* index in the devices file */
    int ordinal;  /* the CUdevice it was made for */
    bool primary;
    bool in_use;  /* pool contexts: created and not yet destroyed */
};

struct alloc {
    CUdeviceptr ptr;
    unsigned long long size;
    int dev;
};

#define MAX_CTX 256

/* Per-process driver state, under g_mu. A forked child resets it. */
static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static unsigned long g_generation = 1; /* bumped in a forked child */
static bool g_inited;
static CUresult g_init_result;
static int g_nvisible;
static int g_visible[MAX_DEVICES];            /* ordinal -> device index */
static int g_primary_refs[MAX_DEVICES];       /* cuDevicePrimaryCtxRetain count */
static int g_other_ctx[MAX_DEVICES];          /* live cuCtxCreate contexts */
static unsigned long long g_charged[MAX_DEVICES]; /* context_bytes charged */
static unsigned long long g_alloc_bytes[MAX_DEVICES];
static struct fake_ctx g_primary[MAX_DEVICES];
static struct fake_ctx g_pool[MAX_CTX];
static struct alloc *g_allocs;
static size_t g_nallocs, g_allocs_cap;
static CUdeviceptr g_next_ptr = 0x7f0000000000ULL;
static uintptr_t g_next_handle = 0x100000; /* streams and events */

/* Each thread's context stack (cuCtxPush/PopCurrent; SetCurrent replaces
 * the top), valid only for the generation it was made in. */
#define CTX_STACK 16
static _Thread_local struct fake_ctx *t_stack[CTX_STACK];
static _Thread_local int t_depth;
static _Thread_local unsigned long t_generation;

static void thread_state(void)
{
    if (t_generation != g_generation) {
        t_generation = g_generation;
        t_depth = 0;
    }
}

static struct fake_ctx *current_ctx(void)
{
    thread_state();
    return t_depth > 0 ? t_stack[t_depth - 1] : NULL;
}

static bool is_our_ctx(const struct fake_ctx *c)
{
    return (c >= g_primary && c < g_primary + MAX_DEVICES) || (c >= g_pool && c < g_pool + MAX_CTX);
}

static bool device_active(int d) { return g_primary_refs[d] > 0 || g_other_ctx[d] > 0; }

static bool ctx_alive(const struct fake_ctx *c)
{
    if (c == NULL || !is_our_ctx(c))
        return false;
    return c->primary ? g_primary_refs[c->dev] > 0 : c->in_use;
}

/* --- fork --------------------------------------------------------------- */

static void atfork_prepare(void) { pthread_mutex_lock(&g_mu); }
static void atfork_parent(void) { pthread_mutex_unlock(&g_mu); }

static void atfork_child(void)
{
    /* A fresh driver: the parent's contexts and allocations are not ours. */
    free(g_allocs);
    g_allocs = NULL;
    g_nallocs = g_allocs_cap = 0;
    g_inited = false;
    g_init_result = CUDA_ERROR_NOT_INITIALIZED;
    g_nvisible = 0;
    memset(g_primary_refs, 0, sizeof g_primary_refs);
    memset(g_other_ctx, 0, sizeof g_other_ctx);
    memset(g_charged, 0, sizeof g_charged);
    memset(g_alloc_bytes, 0, sizeof g_alloc_bytes);
    memset(g_pool, 0, sizeof g_pool);
    g_generation++;
    pthread_mutex_unlock(&g_mu);
}

__attribute__((constructor)) static void fake_gpu_load(void)
{
    pthread_atfork(atfork_prepare, atfork_parent, atfork_child);
}

/* --- the usage file ----------------------------------------------------- */

/* Rewrites DIR/state/<pid>.<d> from this process's state: present while a
 * context exists there or memory is held. */
static CUresult publish(int d)
{
    char path[PATH_LEN], tmp[PATH_LEN];
    if (!fits(snprintf(path, sizeof path, "%s/%ld.%d", state_path(), (long)getpid(), d), sizeof path))
        return CUDA_ERROR_OPERATING_SYSTEM;
    unsigned long long bytes = g_charged[d] + g_alloc_bytes[d];
    if (!device_active(d)) {
        if (unlink(path) != 0 && errno != ENOENT)
            return CUDA_ERROR_OPERATING_SYSTEM;
        return CUDA_SUCCESS;
    }
    if (!ensure_state_dir())
        return CUDA_ERROR_OPERATING_SYSTEM;
    if (!fits(snprintf(tmp, sizeof tmp, "%s/.tmp.%ld.%d", state_path(), (long)getpid(), d), sizeof tmp))
        return CUDA_ERROR_OPERATING_SYSTEM;
    int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0666);
    if (fd < 0)
        return CUDA_ERROR_OPERATING_SYSTEM;
    char buf[32];
    int len = snprintf(buf, sizeof buf, "%llu\n", bytes);
    bool ok = write(fd, buf, (size_t)len) == len;
    ok = close(fd) == 0 && ok;
    if (!ok || rename(tmp, path) != 0) {
        unlink(tmp);
        return CUDA_ERROR_OPERATING_SYSTEM;
    }
    return CUDA_SUCCESS;
}

/* Removes usage files left by an earlier process with our pid. */
static void remove_own_files(void)
{
    DIR *dir = opendir(state_path());
    if (dir == NULL)
        return;
    struct dirent *e;
    while ((e = readdir(dir)) != NULL) {
        long pid;
        int i;
        if (parse_state_name(e->d_name, &pid, &i) && pid == (long)getpid()) {
            char path[PATH_LEN];
            if (fits(snprintf(path, sizeof path, "%s/%s", state_path(), e->d_name), sizeof path))
                unlink(path);
        }
    }
    closedir(dir);
}

/* The cross-process lock around "check free memory, then take it". */
static int lock_state(void)
{
    if (!ensure_state_dir())
        return -1;
    char path[PATH_LEN];
    if (!fits(snprintf(path, sizeof path, "%s/.lock", state_path()), sizeof path))
        return -1;
    int fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0666);
    if (fd < 0)
        return -1;
    while (flock(fd, LOCK_EX) != 0) {
        if (errno != EINTR) {
            close(fd);
            return -1;
        }
    }
    return fd;
}

static void unlock_state(int fd)
{
    flock(fd, LOCK_UN);
    close(fd);
}

/* Takes `bytes` more on device d for this process (a context or an
 * allocation): CUDA_ERROR_OUT_OF_MEMORY unless they fit in what all
 * processes together leave free; otherwise adds them to *counter and
 * rewrites the usage file. The caller holds g_mu. */
static CUresult take_memory(int d, unsigned long long bytes, unsigned long long *counter)
{
    int lock = lock_state();
    if (lock < 0)
        return CUDA_ERROR_OPERATING_SYSTEM;
    struct device devs[MAX_DEVICES];
    CUresult r = CUDA_SUCCESS;
    if (d >= read_devices(devs)) {
        r = CUDA_ERROR_INVALID_DEVICE; /* the devices file lost it */
    } else {
        unsigned long long used = device_used(d, &devs[d]);
        if (bytes > devs[d].total || used > devs[d].total - bytes) {
            r = CUDA_ERROR_OUT_OF_MEMORY;
        } else {
            *counter += bytes;
            r = publish(d);
            if (r != CUDA_SUCCESS)
                *counter -= bytes;
        }
    }
    unlock_state(lock);
    return r;
}

/* Charges context_bytes on device d for its first context, which the
 * caller has just counted (so that the usage file is written even when
 * context_bytes is 0); on failure the caller uncounts it. Holds g_mu. */
static CUresult charge_context(int d)
{
    struct device devs[MAX_DEVICES];
    if (d >= read_devices(devs))
        return CUDA_ERROR_INVALID_DEVICE;
    g_charged[d] = 0;
    return take_memory(d, devs[d].context_bytes, &g_charged[d]);
}

/* The last context on device d is gone: with it go its memory and every
 * allocation made there, as with a real driver. Holds g_mu. */
static void context_gone(int d)
{
    if (device_active(d))
        return;
    size_t k = 0;
    for (size_t j = 0; j < g_nallocs; j++)
        if (g_allocs[j].dev != d)
            g_allocs[k++] = g_allocs[j];
    g_nallocs = k;
    g_alloc_bytes[d] = 0;
    g_charged[d] = 0;
    publish(d);
}

/* --- common checks ------------------------------------------------------ */

static CUresult check_init(void)
{
    if (!g_inited)
        return CUDA_ERROR_NOT_INITIALIZED;
    return g_init_result;
}

/* Ordinal -> device index, for a caller holding g_mu. */
static CUresult ordinal_device(CUdevice ordinal, int *d)
{
    CUresult r = check_init();
    if (r != CUDA_SUCCESS)
        return r;
    if (ordinal < 0 || ordinal >= g_nvisible)
        return CUDA_ERROR_INVALID_DEVICE;
    *d = g_visible[ordinal];
    return CUDA_SUCCESS;
}

/* The device line for `ordinal`. */
static CUresult ordinal_info(CUdevice ordinal, int *d, struct device *out)
{
    pthread_mutex_lock(&g_mu);
    CUresult r = ordinal_device(ordinal, d);
    pthread_mutex_unlock(&g_mu);
    if (r != CUDA_SUCCESS)
        return r;
    struct device devs[MAX_DEVICES];
    if (*d >= read_devices(devs))
        return CUDA_ERROR_INVALID_DEVICE;
    *out = devs[*d];
    return CUDA_SUCCESS;
}

/* --- initialisation and devices ----------------------------------------- */

/* CUDA_VISIBLE_DEVICES -> g_visible. */
static void parse_visible(int n)
{
    g_nvisible = 0;
    const char *env = getenv("CUDA_VISIBLE_DEVICES");
    if (env == NULL) {
        for (int i = 0; i < n; i++)
            g_visible[g_nvisible++] = i;
        return;
    }
    char list[1024];
    snprintf(list, sizeof list, "%s", env);
    char *save = NULL;
    /* strtok_r would skip empty entries; CUDA stops at them. */
    for (char *tok = list; tok != NULL && g_nvisible < MAX_DEVICES; tok = save) {
        char *comma = strchr(tok, ',');
        save = comma ? comma + 1 : NULL;
        if (comma)
            *comma = '\0';
        while (isspace((unsigned char)*tok))
            tok++;
        char *end = tok + strlen(tok);
        while (end > tok && isspace((unsigned char)end[-1]))
            *--end = '\0';
        int found = -1;
        if (*tok != '\0' && strspn(tok, "0123456789") == strlen(tok)) {
            long v = strlen(tok) < 9 ? strtol(tok, NULL, 10) : -1;
            if (v >= 0 && v < n)
                found = (int)v;
        } else if (strncmp(tok, "GPU-", 4) == 0) {
            size_t len = strlen(tok);
            for (int i = 0; i < n; i++) {
                char u[64];
                device_uuid(i, u, sizeof u);
                if (strncmp(u, tok, len) == 0) {
                    if (found >= 0) { /* ambiguous prefix */
                        found = -1;
                        break;
                    }
                    found = i;
                }
            }
        }
        for (int k = 0; k < g_nvisible && found >= 0; k++)
            if (g_visible[k] == found)
                found = -1; /* a repeat ends the list too */
        if (found < 0)
            break;
        g_visible[g_nvisible++] = found;
    }
}

EXPORT CUresult cuInit(unsigned int flags)
{
    if (flags != 0)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_mu);
    if (!g_inited) {
        struct device devs[MAX_DEVICES];
        parse_visible(read_devices(devs));
        remove_own_files();
        g_init_result = g_nvisible > 0 ? CUDA_SUCCESS : CUDA_ERROR_NO_DEVICE;
        g_inited = true;
    }
    CUresult r = g_init_result;
    pthread_mutex_unlock(&g_mu);
    return r;
}

EXPORT CUresult cuDriverGetVersion(int *version)
{
    if (version == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    *version = FAKE_CUDA_VERSION;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuDeviceGetCount(int *count)
{
    if (count == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_mu);
    CUresult r = check_init();
    *count = r == CUDA_SUCCESS ? g_nvisible : 0;
    pthread_mutex_unlock(&g_mu);
    return r == CUDA_ERROR_NO_DEVICE ? CUDA_SUCCESS : r;
}

EXPORT CUresult cuDeviceGet(CUdevice *device, int ordinal)
{
    if (device == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    int d;
    pthread_mutex_lock(&g_mu);
    CUresult r = ordinal_device(ordinal, &d);
    pthread_mutex_unlock(&g_mu);
    if (r == CUDA_SUCCESS)
        *device = ordinal;
    return r;
}

EXPORT CUresult cuDeviceGetName(char *name, int len, CUdevice dev)
{
    int d;
    struct device info;
    CUresult r = ordinal_info(dev, &d, &info);
    if (r != CUDA_SUCCESS)
        return r;
    if (name == NULL || len <= 0)
        return CUDA_ERROR_INVALID_VALUE;
    snprintf(name, (size_t)len, "%s", info.name);
    return CUDA_SUCCESS;
}

EXPORT CUresult cuDeviceGetUuid_v2(CUuuid *uuid, CUdevice dev)
{
    int d;
    struct device info;
    CUresult r = ordinal_info(dev, &d, &info);
    if (r != CUDA_SUCCESS)
        return r;
    if (uuid == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    /* The bytes of GPU-fa4e0000-0000-0000-0000-<index as 12 hex digits>. */
    memset(uuid->bytes, 0, sizeof uuid->bytes);
    uuid->bytes[0] = (char)0xfa;
    uuid->bytes[1] = (char)0x4e;
    for (int k = 0; k < 4; k++)
        uuid->bytes[15 - k] = (char)((unsigned)d >> (8 * k));
    return CUDA_SUCCESS;
}

EXPORT CUresult cuDeviceGetUuid(CUuuid *uuid, CUdevice dev) { return cuDeviceGetUuid_v2(uuid, dev); }

EXPORT CUresult cuDeviceGetPCIBusId(char *busId, int len, CUdevice dev)
{
    int d;
    struct device info;
    CUresult r = ordinal_info(dev, &d, &info);
    if (r != CUDA_SUCCESS)
        return r;
    if (busId == NULL || len <= 0)
        return CUDA_ERROR_INVALID_VALUE;
    nvmlPciInfo_t pci;
    fill_pci(d, &pci);
    snprintf(busId, (size_t)len, "%s", pci.busIdLegacy);
    return CUDA_SUCCESS;
}

EXPORT CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice dev)
{
    int d;
    struct device info;
    CUresult r = ordinal_info(dev, &d, &info);
    if (r != CUDA_SUCCESS)
        return r;
    if (bytes == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    *bytes = (size_t)info.total;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuDeviceGetAttribute(int *pi, int attrib, CUdevice dev)
{
    int d;
    struct device info;
    CUresult r = ordinal_info(dev, &d, &info);
    if (r != CUDA_SUCCESS)
        return r;
    if (pi == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    switch (attrib) {
    case CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED: *pi = info.mempools; break;
    case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR: *pi = 9; break;
    case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR: *pi = 0; break;
    case CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK: *pi = 1024; break;
    case CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK: *pi = 49152; break;
    case CU_DEVICE_ATTRIBUTE_WARP_SIZE: *pi = 32; break;
    case CU_DEVICE_ATTRIBUTE_CLOCK_RATE: *pi = 1980000; break;
    case CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT: *pi = 132; break;
    case CU_DEVICE_ATTRIBUTE_CONCURRENT_KERNELS: *pi = 1; break;
    case CU_DEVICE_ATTRIBUTE_PCI_BUS_ID: *pi = 0x10 + d; break;
    case CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID: *pi = 0; break;
    case CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID: *pi = 0; break;
    case CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH: *pi = 5120; break;
    case CU_DEVICE_ATTRIBUTE_ASYNC_ENGINE_COUNT: *pi = 2; break;
    case CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING: *pi = 1; break;
    default: *pi = 0; break;
    }
    return CUDA_SUCCESS;
}

/* --- contexts ----------------------------------------------------------- */

EXPORT CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev)
{
    if (pctx == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    int d;
    pthread_mutex_lock(&g_mu);
    CUresult r = ordinal_device(dev, &d);
    if (r == CUDA_SUCCESS) {
        bool first = !device_active(d);
        g_primary_refs[d]++;
        if (first && (r = charge_context(d)) != CUDA_SUCCESS)
            g_primary_refs[d]--;
    }
    if (r == CUDA_SUCCESS) {
        struct fake_ctx *c = &g_primary[d];
        c->dev = d;
        c->ordinal = dev;
        c->primary = true;
        c->in_use = true;
        *pctx = c;
    }
    pthread_mutex_unlock(&g_mu);
    return r;
}

/* Releases one reference; at zero the primary context is destroyed, and
 * with it what the process allocated there. */
EXPORT CUresult cuDevicePrimaryCtxRelease_v2(CUdevice dev)
{
    int d;
    pthread_mutex_lock(&g_mu);
    CUresult r = ordinal_device(dev, &d);
    if (r == CUDA_SUCCESS) {
        if (g_primary_refs[d] == 0) {
            r = CUDA_ERROR_INVALID_CONTEXT;
        } else if (--g_primary_refs[d] == 0) {
            context_gone(d);
        }
    }
    pthread_mutex_unlock(&g_mu);
    return r;
}

EXPORT CUresult cuDevicePrimaryCtxRelease(CUdevice dev) { return cuDevicePrimaryCtxRelease_v2(dev); }

EXPORT CUresult cuDevicePrimaryCtxReset_v2(CUdevice dev)
{
    int d;
    pthread_mutex_lock(&g_mu);
    CUresult r = ordinal_device(dev, &d);
    if (r == CUDA_SUCCESS && g_primary_refs[d] > 0) {
        g_primary_refs[d] = 0;
        context_gone(d);
    }
    pthread_mutex_unlock(&g_mu);
    return r;
}

EXPORT CUresult cuDevicePrimaryCtxReset(CUdevice dev) { return cuDevicePrimaryCtxReset_v2(dev); }

EXPORT CUresult cuDevicePrimaryCtxGetState(CUdevice dev, unsigned int *flags, int *active)
{
    int d;
    pthread_mutex_lock(&g_mu);
    CUresult r = ordinal_device(dev, &d);
    if (r == CUDA_SUCCESS) {
        if (flags)
            *flags = 0;
        if (active)
            *active = g_primary_refs[d] > 0;
    }
    pthread_mutex_unlock(&g_mu);
    return r;
}

EXPORT CUresult cuDevicePrimaryCtxSetFlags_v2(CUdevice dev, unsigned int flags)
{
    (void)flags;
    int d;
    pthread_mutex_lock(&g_mu);
    CUresult r = ordinal_device(dev, &d);
    pthread_mutex_unlock(&g_mu);
    return r;
}

EXPORT CUresult cuDevicePrimaryCtxSetFlags(CUdevice dev, unsigned int flags)
{
    return cuDevicePrimaryCtxSetFlags_v2(dev, flags);
}

/* A new (non-primary) context, made current on the calling thread. */
static CUresult create_context(CUcontext *pctx, CUdevice dev)
{
    if (pctx == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    int d;
    pthread_mutex_lock(&g_mu);
    CUresult r = ordinal_device(dev, &d);
    struct fake_ctx *c = NULL;
    if (r == CUDA_SUCCESS) {
        for (int k = 0; k < MAX_CTX && c == NULL; k++)
            if (!g_pool[k].in_use)
                c = &g_pool[k];
        if (c == NULL)
            r = CUDA_ERROR_OUT_OF_MEMORY;
    }
    if (r == CUDA_SUCCESS) {
        bool first = !device_active(d);
        g_other_ctx[d]++;
        if (first && (r = charge_context(d)) != CUDA_SUCCESS)
            g_other_ctx[d]--;
    }
    if (r == CUDA_SUCCESS) {
        c->dev = d;
        c->ordinal = dev;
        c->primary = false;
        c->in_use = true;
        thread_state();
        if (t_depth < CTX_STACK)
            t_stack[t_depth++] = c;
        else
            t_stack[CTX_STACK - 1] = c;
        *pctx = c;
    }
    pthread_mutex_unlock(&g_mu);
    return r;
}

EXPORT CUresult cuCtxCreate_v2(CUcontext *pctx, unsigned int flags, CUdevice dev)
{
    (void)flags;
    return create_context(pctx, dev);
}

EXPORT CUresult cuCtxCreate_v3(CUcontext *pctx, void *paramsArray, int numParams, unsigned int flags, CUdevice dev)
{
    (void)paramsArray;
    (void)numParams;
    (void)flags;
    return create_context(pctx, dev);
}

EXPORT CUresult cuCtxCreate_v4(CUcontext *pctx, void *ctxCreateParams, unsigned int flags, CUdevice dev)
{
    (void)ctxCreateParams;
    (void)flags;
    return create_context(pctx, dev);
}

EXPORT CUresult cuCtxDestroy_v2(CUcontext ctx)
{
    pthread_mutex_lock(&g_mu);
    CUresult r = CUDA_SUCCESS;
    if (!is_our_ctx(ctx) || ctx->primary || !ctx->in_use) {
        r = CUDA_ERROR_INVALID_CONTEXT;
    } else {
        ctx->in_use = false;
        g_other_ctx[ctx->dev]--;
        context_gone(ctx->dev);
        thread_state();
        if (t_depth > 0 && t_stack[t_depth - 1] == ctx)
            t_depth--;
    }
    pthread_mutex_unlock(&g_mu);
    return r;
}

EXPORT CUresult cuCtxGetCurrent(CUcontext *pctx)
{
    if (pctx == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_mu);
    CUresult r = check_init();
    *pctx = r == CUDA_SUCCESS ? current_ctx() : NULL;
    pthread_mutex_unlock(&g_mu);
    return r;
}

EXPORT CUresult cuCtxSetCurrent(CUcontext ctx)
{
    pthread_mutex_lock(&g_mu);
    CUresult r = check_init();
    if (r == CUDA_SUCCESS) {
        thread_state();
        if (ctx == NULL) {
            if (t_depth > 0)
                t_depth--;
        } else if (!is_our_ctx(ctx)) {
            r = CUDA_ERROR_INVALID_CONTEXT;
        } else if (t_depth == 0) {
            t_stack[t_depth++] = ctx;
        } else {
            t_stack[t_depth - 1] = ctx;
        }
    }
    pthread_mutex_unlock(&g_mu);
    return r;
}

EXPORT CUresult cuCtxPushCurrent_v2(CUcontext ctx)
{
    pthread_mutex_lock(&g_mu);
    CUresult r = check_init();
    if (r == CUDA_SUCCESS && !ctx_alive(ctx))
        r = CUDA_ERROR_INVALID_CONTEXT;
    if (r == CUDA_SUCCESS) {
        thread_state();
        if (t_depth < CTX_STACK)
            t_stack[t_depth++] = ctx;
        else
            r = CUDA_ERROR_INVALID_VALUE;
    }
    pthread_mutex_unlock(&g_mu);
    return r;
}

EXPORT CUresult cuCtxPopCurrent_v2(CUcontext *pctx)
{
    pthread_mutex_lock(&g_mu);
    CUresult r = check_init();
    if (r == CUDA_SUCCESS) {
        thread_state();
        if (t_depth == 0) {
            r = CUDA_ERROR_INVALID_CONTEXT;
        } else {
            t_depth--;
            if (pctx)
                *pctx = t_stack[t_depth];
        }
    }
    pthread_mutex_unlock(&g_mu);
    return r;
}

EXPORT CUresult cuCtxGetDevice(CUdevice *device)
{
    if (device == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_mu);
    CUresult r = check_init();
    struct fake_ctx *c = current_ctx();
    if (r == CUDA_SUCCESS && !ctx_alive(c))
        r = CUDA_ERROR_INVALID_CONTEXT;
    if (r == CUDA_SUCCESS)
        *device = c->ordinal;
    pthread_mutex_unlock(&g_mu);
    return r;
}

EXPORT CUresult cuCtxGetDevice_v2(CUdevice *device, CUcontext ctx)
{
    if (ctx == NULL)
        return cuCtxGetDevice(device);
    if (device == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_mu);
    CUresult r = check_init();
    if (r == CUDA_SUCCESS && !ctx_alive(ctx))
        r = CUDA_ERROR_INVALID_CONTEXT;
    if (r == CUDA_SUCCESS)
        *device = ctx->ordinal;
    pthread_mutex_unlock(&g_mu);
    return r;
}

EXPORT CUresult cuCtxSynchronize(void) { return CUDA_SUCCESS; }

EXPORT CUresult cuCtxSynchronize_v2(CUcontext ctx)
{
    (void)ctx;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuCtxSetFlags(unsigned int flags)
{
    (void)flags;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuCtxGetFlags(unsigned int *flags)
{
    if (flags)
        *flags = 0;
    return CUDA_SUCCESS;
}

/* --- memory ------------------------------------------------------------- */

/* The device of the calling thread's current context. Holds g_mu. */
static CUresult current_device(int *d)
{
    CUresult r = check_init();
    if (r != CUDA_SUCCESS)
        return r;
    struct fake_ctx *c = current_ctx();
    if (!ctx_alive(c))
        return CUDA_ERROR_INVALID_CONTEXT;
    *d = c->dev;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuMemGetInfo_v2(size_t *free_bytes, size_t *total_bytes)
{
    int d;
    pthread_mutex_lock(&g_mu);
    CUresult r = current_device(&d);
    pthread_mutex_unlock(&g_mu);
    if (r != CUDA_SUCCESS)
        return r;
    struct device devs[MAX_DEVICES];
    if (d >= read_devices(devs))
        return CUDA_ERROR_INVALID_DEVICE;
    unsigned long long used = device_used(d, &devs[d]);
    if (free_bytes)
        *free_bytes = used >= devs[d].total ? 0 : (size_t)(devs[d].total - used);
    if (total_bytes)
        *total_bytes = (size_t)devs[d].total;
    return CUDA_SUCCESS;
}

/* Allocates `size` (> 0) bytes on the current context's device. */
static CUresult allocate(CUdeviceptr *dptr, size_t size)
{
    int d;
    pthread_mutex_lock(&g_mu);
    CUresult r = current_device(&d);
    if (r == CUDA_SUCCESS && g_nallocs == g_allocs_cap) {
        size_t cap = g_allocs_cap ? g_allocs_cap * 2 : 64;
        struct alloc *grown = realloc(g_allocs, cap * sizeof *grown);
        if (grown == NULL) {
            r = CUDA_ERROR_OUT_OF_MEMORY;
        } else {
            g_allocs = grown;
            g_allocs_cap = cap;
        }
    }
    if (r == CUDA_SUCCESS)
        r = take_memory(d, size, &g_alloc_bytes[d]);
    if (r == CUDA_SUCCESS) {
        CUdeviceptr p = g_next_ptr;
        /* Keep pointers 2 MiB aligned and apart, like the real allocator. */
        g_next_ptr += ((unsigned long long)size + (2ULL << 20) - 1) & ~((2ULL << 20) - 1);
        g_allocs[g_nallocs++] = (struct alloc){.ptr = p, .size = size, .dev = d};
        *dptr = p;
    }
    pthread_mutex_unlock(&g_mu);
    return r;
}

static CUresult release(CUdeviceptr ptr)
{
    if (ptr == 0)
        return CUDA_SUCCESS;
    pthread_mutex_lock(&g_mu);
    CUresult r = check_init();
    if (r == CUDA_SUCCESS) {
        r = CUDA_ERROR_INVALID_VALUE;
        for (size_t j = 0; j < g_nallocs; j++) {
            if (g_allocs[j].ptr == ptr) {
                int d = g_allocs[j].dev;
                g_alloc_bytes[d] -= g_allocs[j].size;
                g_allocs[j] = g_allocs[--g_nallocs];
                publish(d);
                r = CUDA_SUCCESS;
                break;
            }
        }
    }
    pthread_mutex_unlock(&g_mu);
    return r;
}

/* Like the real driver, cuMemAlloc rejects 0 bytes. */
EXPORT CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize)
{
    if (dptr == NULL || bytesize == 0)
        return CUDA_ERROR_INVALID_VALUE;
    return allocate(dptr, bytesize);
}

/* cuMemAllocAsync accepts 0 bytes and gives a null pointer. */
EXPORT CUresult cuMemAllocAsync(CUdeviceptr *dptr, size_t bytesize, CUstream stream)
{
    (void)stream;
    if (dptr == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    if (bytesize == 0) {
        pthread_mutex_lock(&g_mu);
        int d;
        CUresult r = current_device(&d);
        pthread_mutex_unlock(&g_mu);
        if (r == CUDA_SUCCESS)
            *dptr = 0;
        return r;
    }
    return allocate(dptr, bytesize);
}

EXPORT CUresult cuMemFree_v2(CUdeviceptr dptr) { return release(dptr); }

EXPORT CUresult cuMemFreeAsync(CUdeviceptr dptr, CUstream stream)
{
    (void)stream;
    return release(dptr);
}

/* No memory behind the pointers: sets do nothing, copies to the host give
 * zeros. */
EXPORT CUresult cuMemsetD8_v2(CUdeviceptr dst, unsigned char uc, size_t n)
{
    (void)dst, (void)uc, (void)n;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuMemsetD8Async(CUdeviceptr dst, unsigned char uc, size_t n, CUstream stream)
{
    (void)dst, (void)uc, (void)n, (void)stream;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuMemsetD32_v2(CUdeviceptr dst, unsigned int ui, size_t n)
{
    (void)dst, (void)ui, (void)n;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuMemsetD32Async(CUdeviceptr dst, unsigned int ui, size_t n, CUstream stream)
{
    (void)dst, (void)ui, (void)n, (void)stream;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuMemcpyHtoD_v2(CUdeviceptr dst, const void *src, size_t n)
{
    (void)dst, (void)src, (void)n;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void *src, size_t n, CUstream stream)
{
    (void)dst, (void)src, (void)n, (void)stream;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuMemcpyDtoH_v2(void *dst, CUdeviceptr src, size_t n)
{
    (void)src;
    if (dst != NULL)
        memset(dst, 0, n);
    return CUDA_SUCCESS;
}

EXPORT CUresult cuMemcpyDtoHAsync_v2(void *dst, CUdeviceptr src, size_t n, CUstream stream)
{
    (void)stream;
    return cuMemcpyDtoH_v2(dst, src, n);
}

EXPORT CUresult cuMemcpyDtoD_v2(CUdeviceptr dst, CUdeviceptr src, size_t n)
{
    (void)dst, (void)src, (void)n;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream stream)
{
    (void)dst, (void)src, (void)n, (void)stream;
    return CUDA_SUCCESS;
}

/* --- streams and events: handles only ----------------------------------- */

static void *new_handle(void)
{
    pthread_mutex_lock(&g_mu);
    void *h = (void *)g_next_handle;
    g_next_handle += 16;
    pthread_mutex_unlock(&g_mu);
    return h;
}

EXPORT CUresult cuStreamCreate(CUstream *phStream, unsigned int flags)
{
    (void)flags;
    if (phStream == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    *phStream = new_handle();
    return CUDA_SUCCESS;
}

EXPORT CUresult cuStreamCreateWithPriority(CUstream *phStream, unsigned int flags, int priority)
{
    (void)priority;
    return cuStreamCreate(phStream, flags);
}

EXPORT CUresult cuStreamDestroy_v2(CUstream stream)
{
    (void)stream;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuStreamSynchronize(CUstream stream)
{
    (void)stream;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuStreamQuery(CUstream stream)
{
    (void)stream;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuStreamWaitEvent(CUstream stream, CUevent event, unsigned int flags)
{
    (void)stream, (void)event, (void)flags;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuEventCreate(CUevent *phEvent, unsigned int flags)
{
    (void)flags;
    if (phEvent == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    *phEvent = new_handle();
    return CUDA_SUCCESS;
}

EXPORT CUresult cuEventRecord(CUevent event, CUstream stream)
{
    (void)event, (void)stream;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuEventSynchronize(CUevent event)
{
    (void)event;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuEventQuery(CUevent event)
{
    (void)event;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuEventDestroy_v2(CUevent event)
{
    (void)event;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuEventElapsedTime(float *ms, CUevent start, CUevent end)
{
    (void)start, (void)end;
    if (ms == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    *ms = 0.0f;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuEventElapsedTime_v2(float *ms, CUevent start, CUevent end)
{
    return cuEventElapsedTime(ms, start, end);
}

/* --- the checkpoint API (CUDA 12.8+) ------------------------------------ */
/*
 * An external controller locks a CUDA process, moves its device memory into
 * its host memory (checkpoint), later moves it back (restore) and unlocks
 * it. Here: the controller calls these in its own process with the target's
 * pid; a checkpoint moves the target's DIR/state/<pid>.<d> files into
 * DIR/state/.ckpt.<pid> (so NVML shows the memory gone), a restore puts them
 * back if they fit beside what every other process holds (else
 * CUDA_ERROR_OUT_OF_MEMORY, the target still checkpointed). The target
 * itself is not told: it is idle while it sleeps, as berth drains it first.
 * DIR/checkpoint-fail holding a step's name (lock, checkpoint, restore,
 * unlock) makes that step fail with CUDA_ERROR_UNKNOWN; DIR/no-checkpoint
 * makes every call CUDA_ERROR_NOT_SUPPORTED (a driver without the API).
 */

enum {
    CU_PROCESS_STATE_RUNNING = 0,
    CU_PROCESS_STATE_LOCKED = 1,
    CU_PROCESS_STATE_CHECKPOINTED = 2,
    CU_PROCESS_STATE_FAILED = 3,
};

struct ckpt {
    int state;
    int n;
    int index[MAX_DEVICES];
    unsigned long long bytes[MAX_DEVICES];
};

static bool ckpt_path(int pid, char *out, size_t len)
{
    return fits(snprintf(out, len, "%s/.ckpt.%d", state_path(), pid), len);
}

static void ckpt_read(int pid, struct ckpt *c)
{
    memset(c, 0, sizeof *c);
    char path[PATH_LEN];
    if (!ckpt_path(pid, path, sizeof path))
        return;
    FILE *f = fopen(path, "re");
    if (f == NULL)
        return;
    if (fscanf(f, "%d", &c->state) != 1)
        c->state = CU_PROCESS_STATE_RUNNING;
    while (c->n < MAX_DEVICES && fscanf(f, " %d:%llu", &c->index[c->n], &c->bytes[c->n]) == 2)
        c->n++;
    fclose(f);
}

static CUresult ckpt_write(int pid, const struct ckpt *c)
{
    char path[PATH_LEN];
    if (!ckpt_path(pid, path, sizeof path))
        return CUDA_ERROR_OPERATING_SYSTEM;
    if (c->state == CU_PROCESS_STATE_RUNNING) {
        unlink(path);
        return CUDA_SUCCESS;
    }
    FILE *f = fopen(path, "we");
    if (f == NULL)
        return CUDA_ERROR_OPERATING_SYSTEM;
    fprintf(f, "%d", c->state);
    for (int k = 0; k < c->n; k++)
        fprintf(f, " %d:%llu", c->index[k], c->bytes[k]);
    fprintf(f, "\n");
    return fclose(f) == 0 ? CUDA_SUCCESS : CUDA_ERROR_OPERATING_SYSTEM;
}

/* The flag files: whether step `step` is told to fail, or the API is off. */
static CUresult ckpt_told(const char *step)
{
    char path[PATH_LEN];
    snprintf(path, sizeof path, "%s/no-checkpoint", dir_path());
    if (access(path, F_OK) == 0)
        return CUDA_ERROR_NOT_SUPPORTED;
    snprintf(path, sizeof path, "%s/checkpoint-fail", dir_path());
    FILE *f = fopen(path, "re");
    if (f == NULL)
        return CUDA_SUCCESS;
    char what[32] = "";
    bool hit = fscanf(f, "%31s", what) == 1 && strcmp(what, step) == 0;
    fclose(f);
    return hit ? CUDA_ERROR_UNKNOWN : CUDA_SUCCESS;
}

/* Whether `pid` holds anything on a device (is a CUDA process). */
static bool ckpt_is_cuda(int pid)
{
    for (int d = 0; d < MAX_DEVICES; d++) {
        char path[PATH_LEN];
        unsigned long long bytes;
        if (fits(snprintf(path, sizeof path, "%s/%d.%d", state_path(), pid, d), sizeof path) &&
            read_bytes_file(path, &bytes))
            return true;
    }
    return false;
}

typedef struct {
    unsigned int timeoutMs;
    unsigned int reserved0;
    unsigned long long reserved1[7];
} CUcheckpointLockArgs;

EXPORT CUresult cuCheckpointProcessGetState(int pid, int *state)
{
    if (state == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult r = ckpt_told("state");
    if (r == CUDA_ERROR_NOT_SUPPORTED)
        return r;
    if (!pid_alive(pid))
        return CUDA_ERROR_INVALID_VALUE;
    struct ckpt c;
    ckpt_read(pid, &c);
    *state = c.state;
    return CUDA_SUCCESS;
}

/* One step: `from` the state it needs, `to` the state after, `move` what
 * happens to the memory (+1 out to the host, -1 back to the device). */
static CUresult ckpt_step(int pid, const char *step, int from, int to, int move)
{
    CUresult r = ckpt_told(step);
    if (r != CUDA_SUCCESS)
        return r;
    if (!pid_alive(pid))
        return CUDA_ERROR_INVALID_VALUE;
    int fd = lock_state();
    if (fd < 0)
        return CUDA_ERROR_OPERATING_SYSTEM;
    struct ckpt c;
    ckpt_read(pid, &c);
    if (c.state == CU_PROCESS_STATE_RUNNING && from == CU_PROCESS_STATE_RUNNING && !ckpt_is_cuda(pid)) {
        unlock_state(fd);
        return CUDA_ERROR_INVALID_VALUE; /* not a CUDA process */
    }
    if (c.state != from) {
        unlock_state(fd);
        return CUDA_ERROR_ILLEGAL_STATE;
    }
    if (move > 0) {
        c.n = 0;
        for (int d = 0; d < MAX_DEVICES; d++) {
            char path[PATH_LEN];
            unsigned long long bytes;
            if (!fits(snprintf(path, sizeof path, "%s/%d.%d", state_path(), pid, d), sizeof path) ||
                !read_bytes_file(path, &bytes))
                continue;
            c.index[c.n] = d;
            c.bytes[c.n] = bytes;
            c.n++;
            unlink(path);
        }
    } else if (move < 0) {
        struct device devs[MAX_DEVICES];
        int ndev = read_devices(devs);
        for (int k = 0; k < c.n; k++) {
            int d = c.index[k];
            if (d >= ndev || device_used(d, &devs[d]) + c.bytes[k] > devs[d].total) {
                unlock_state(fd);
                return CUDA_ERROR_OUT_OF_MEMORY;
            }
        }
        for (int k = 0; k < c.n; k++) {
            char path[PATH_LEN];
            if (!fits(snprintf(path, sizeof path, "%s/%d.%d", state_path(), pid, c.index[k]), sizeof path))
                continue;
            FILE *f = fopen(path, "we");
            if (f != NULL) {
                fprintf(f, "%llu\n", c.bytes[k]);
                fclose(f);
            }
        }
        c.n = 0;
    }
    c.state = to;
    r = ckpt_write(pid, &c);
    unlock_state(fd);
    return r;
}

EXPORT CUresult cuCheckpointProcessLock(int pid, CUcheckpointLockArgs *args)
{
    (void)args;
    return ckpt_step(pid, "lock", CU_PROCESS_STATE_RUNNING, CU_PROCESS_STATE_LOCKED, 0);
}

EXPORT CUresult cuCheckpointProcessCheckpoint(int pid, void *args)
{
    (void)args;
    return ckpt_step(pid, "checkpoint", CU_PROCESS_STATE_LOCKED, CU_PROCESS_STATE_CHECKPOINTED, 1);
}

EXPORT CUresult cuCheckpointProcessRestore(int pid, void *args)
{
    (void)args;
    return ckpt_step(pid, "restore", CU_PROCESS_STATE_CHECKPOINTED, CU_PROCESS_STATE_LOCKED, -1);
}

EXPORT CUresult cuCheckpointProcessUnlock(int pid, void *args)
{
    (void)args;
    return ckpt_step(pid, "unlock", CU_PROCESS_STATE_LOCKED, CU_PROCESS_STATE_RUNNING, 0);
}

/* --- errors ------------------------------------------------------------- */

static const struct {
    int code;
    const char *name, *text;
} g_cuda_errors[] = {
    {0, "CUDA_SUCCESS", "no error"},
    {1, "CUDA_ERROR_INVALID_VALUE", "invalid argument"},
    {2, "CUDA_ERROR_OUT_OF_MEMORY", "out of memory"},
    {3, "CUDA_ERROR_NOT_INITIALIZED", "initialization error"},
    {4, "CUDA_ERROR_DEINITIALIZED", "driver shutting down"},
    {100, "CUDA_ERROR_NO_DEVICE", "no CUDA-capable device is detected"},
    {101, "CUDA_ERROR_INVALID_DEVICE", "invalid device ordinal"},
    {201, "CUDA_ERROR_INVALID_CONTEXT", "invalid device context"},
    {304, "CUDA_ERROR_OPERATING_SYSTEM", "OS call failed or operation not supported on this OS"},
    {400, "CUDA_ERROR_INVALID_HANDLE", "invalid resource handle"},
    {401, "CUDA_ERROR_ILLEGAL_STATE", "the operation cannot be performed in the present state"},
    {500, "CUDA_ERROR_NOT_FOUND", "named symbol not found"},
    {600, "CUDA_ERROR_NOT_READY", "device not ready"},
    {708, "CUDA_ERROR_PRIMARY_CONTEXT_ACTIVE", "primary context active"},
    {709, "CUDA_ERROR_CONTEXT_IS_DESTROYED", "context is destroyed"},
    {801, "CUDA_ERROR_NOT_SUPPORTED", "operation not supported"},
    {999, "CUDA_ERROR_UNKNOWN", "unknown error"},
};

static CUresult describe(CUresult error, const char **out, bool name)
{
    if (out == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    for (size_t k = 0; k < sizeof g_cuda_errors / sizeof g_cuda_errors[0]; k++) {
        if (g_cuda_errors[k].code == error) {
            *out = name ? g_cuda_errors[k].name : g_cuda_errors[k].text;
            return CUDA_SUCCESS;
        }
    }
    *out = NULL;
    return CUDA_ERROR_INVALID_VALUE;
}

EXPORT CUresult cuGetErrorString(CUresult error, const char **pStr) { return describe(error, pStr, false); }

EXPORT CUresult cuGetErrorName(CUresult error, const char **pStr) { return describe(error, pStr, true); }
