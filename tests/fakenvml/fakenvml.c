/*
 * fakenvml.c - a fake NVIDIA Management Library (libnvidia-ml.so.1) for tests.
 *
 * The real `pynvml` binding (nvidia-ml-py) loads this library with ctypes and
 * calls its symbols by name, so the structures below mirror pynvml's ctypes
 * definitions byte for byte (checked with _Static_assert and by the tests).
 *
 * Every value comes from a plain-text config file named by the environment
 * variable FAKE_NVML_CONFIG (see README.md in this directory for the keys).
 * The file is read at nvmlInit and re-read whenever stat() says it changed
 * (inode, size or mtime; a file modified less than a second before it was
 * loaded is re-read on every call, so two same-size writes within one clock
 * tick are never missed).  Writers replace the file atomically (rename).
 *
 * Optional: FAKE_NVML_STATS=/path makes the library rewrite /path (atomically)
 * on every API call with one "name count" line per function called so far in
 * this process.
 *
 * Thread-safe: one mutex guards all state; it is never held while sleeping
 * (delay_ms, nvmlEventSetWait_v2 waiting for the config to change).
 *
 * Build: gcc -std=c11 -shared -fPIC -O2 -Wall -Wextra -Werror -pthread \
 *            -Wl,-soname,libnvidia-ml.so.1 -o libnvidia-ml.so.1 fakenvml.c
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/inotify.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define EXPORT __attribute__((visibility("default")))

/* ------------------------------------------------------------------------ */
/* NVML ABI (as nvidia-ml-py's ctypes definitions describe it)              */
/* ------------------------------------------------------------------------ */

typedef int nvmlReturn_t;

#define NVML_SUCCESS 0
#define NVML_ERROR_UNINITIALIZED 1
#define NVML_ERROR_INVALID_ARGUMENT 2
#define NVML_ERROR_NOT_SUPPORTED 3
#define NVML_ERROR_NOT_FOUND 6
#define NVML_ERROR_INSUFFICIENT_SIZE 7
#define NVML_ERROR_DRIVER_NOT_LOADED 9
#define NVML_ERROR_TIMEOUT 10
#define NVML_ERROR_GPU_IS_LOST 15
#define NVML_ERROR_MEMORY 20
#define NVML_ERROR_ARGUMENT_VERSION_MISMATCH 25
#define NVML_ERROR_UNKNOWN 999

#define NVML_VALUE_TYPE_UNSIGNED_INT 1
#define NVML_VALUE_TYPE_UNSIGNED_LONG_LONG 3
#define NVML_FI_DEV_MEMORY_TEMP 82
#define NVML_FI_DEV_NVLINK_LINK_COUNT 91
#define NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX 138 /* KiB since the driver loaded; scopeId = link */
#define NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX 139
#define NVML_NVLINK_ERROR_DL_ECC_DATA 4 /* the counters below it come from the config */
#define NVML_PERF_POLICY_RELIABILITY 5  /* policies 0..5 come from the config */
#define NVML_PERF_POLICY_COUNT 12
#define NVML_EVENT_TYPE_XID_CRITICAL_ERROR 0x8ULL
#define NVML_MEMORY_V2_VERSION 0x02000028u /* pynvml.nvmlMemory_v2 */
#define NVML_NO_INSTANCE 0xFFFFFFFFu       /* gpu/compute instance id: not MIG */

struct fake_device;
struct fake_event_set;
struct fake_mig;            /* a MIG device handle (section "MIG") */
struct fake_gpu_instance;   /* a GPU instance handle (section "MIG") */
typedef struct fake_device *nvmlDevice_t;
typedef struct fake_event_set *nvmlEventSet_t;

typedef struct {
    char busIdLegacy[16];
    unsigned int domain;
    unsigned int bus;
    unsigned int device;
    unsigned int pciDeviceId;
    unsigned int pciSubSystemId;
    char busId[32];
} nvmlPciInfo_t;

typedef struct {
    unsigned int gpu;
    unsigned int memory;
} nvmlUtilization_t;

typedef struct {
    unsigned long long total;
    unsigned long long free;
    unsigned long long used;
} nvmlMemory_t;

typedef struct {
    unsigned int version;
    unsigned long long total;
    unsigned long long reserved;
    unsigned long long free;
    unsigned long long used;
} nvmlMemory_v2_t;

typedef union {
    double dVal;
    unsigned int uiVal;
    unsigned long ulVal;
    unsigned long long ullVal;
    long long sllVal;
    int siVal;
    unsigned short usVal;
} nvmlValue_t;

typedef struct {
    uint32_t fieldId;
    uint32_t scopeId;
    int64_t timestamp;
    int64_t latencyUsec;
    unsigned int valueType;
    nvmlReturn_t nvmlReturn;
    nvmlValue_t value;
} nvmlFieldValue_t;

typedef struct { /* pynvml c_nvmlProcessInfo_v3_t == c_nvmlProcessInfo_v2_t */
    unsigned int pid;
    unsigned long long usedGpuMemory;
    unsigned int gpuInstanceId;
    unsigned int computeInstanceId;
} nvmlProcessInfo_t;

typedef struct {
    unsigned int pid;
    unsigned long long timeStamp;
    unsigned int smUtil;
    unsigned int memUtil;
    unsigned int encUtil;
    unsigned int decUtil;
} nvmlProcessUtilizationSample_t;

typedef struct {
    nvmlDevice_t device;
    unsigned long long eventType;
    unsigned long long eventData;
    unsigned int gpuInstanceId;
    unsigned int computeInstanceId;
} nvmlEventData_t;

typedef struct {
    unsigned long long referenceTime; /* µs since the epoch */
    unsigned long long violationTime; /* ns since the driver loaded */
} nvmlViolationTime_t;

_Static_assert(sizeof(nvmlPciInfo_t) == 68, "nvmlPciInfo_t layout");
_Static_assert(sizeof(nvmlUtilization_t) == 8, "nvmlUtilization_t layout");
_Static_assert(sizeof(nvmlMemory_t) == 24, "nvmlMemory_t layout");
_Static_assert(sizeof(nvmlMemory_v2_t) == 40, "nvmlMemory_v2_t layout");
_Static_assert(sizeof(nvmlFieldValue_t) == 40, "nvmlFieldValue_t layout");
_Static_assert(sizeof(nvmlProcessInfo_t) == 24, "nvmlProcessInfo_t layout");
_Static_assert(sizeof(nvmlProcessUtilizationSample_t) == 32, "sample layout");
_Static_assert(sizeof(nvmlEventData_t) == 32, "nvmlEventData_t layout");
_Static_assert(sizeof(nvmlViolationTime_t) == 16, "nvmlViolationTime_t layout");

/* ------------------------------------------------------------------------ */
/* Time                                                                     */
/* ------------------------------------------------------------------------ */

static long long ts_diff_ns(const struct timespec *a, const struct timespec *b)
{
    return (long long)(a->tv_sec - b->tv_sec) * 1000000000LL + (a->tv_nsec - b->tv_nsec);
}

static unsigned long long now_us(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (unsigned long long)ts.tv_sec * 1000000ull + (unsigned long long)ts.tv_nsec / 1000ull;
}

static long long mono_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000LL + ts.tv_nsec / 1000000LL;
}

static void sleep_ms(unsigned long long ms)
{
    struct timespec req, rem;
    if (!ms)
        return;
    req.tv_sec = (time_t)(ms / 1000ull);
    req.tv_nsec = (long)(ms % 1000ull) * 1000000L;
    while (nanosleep(&req, &rem) != 0 && errno == EINTR)
        req = rem;
}

/* ------------------------------------------------------------------------ */
/* Call counters                                                            */
/* ------------------------------------------------------------------------ */

/* The MIG calls (section "MIG" below). */
#define MIG_FN_LIST(X)                              \
    X(nvmlDeviceGetMigMode)                         \
    X(nvmlDeviceGetMaxMigDeviceCount)               \
    X(nvmlDeviceGetMigDeviceHandleByIndex)          \
    X(nvmlDeviceIsMigDeviceHandle)                  \
    X(nvmlDeviceGetGpuInstanceId)                   \
    X(nvmlDeviceGetComputeInstanceId)               \
    X(nvmlDeviceGetDeviceHandleFromMigDeviceHandle) \
    X(nvmlDeviceGetGpuInstanceProfileInfo)          \
    X(nvmlDeviceGetGpuInstanceProfileInfoV)         \
    X(nvmlDeviceGetGpuInstances)                    \
    X(nvmlDeviceGetGpuInstanceById)                 \
    X(nvmlGpuInstanceGetInfo)

#define FN_LIST(X)                                  \
    X(nvmlInitWithFlags)                            \
    X(nvmlInit_v2)                                  \
    X(nvmlShutdown)                                 \
    X(nvmlErrorString)                              \
    X(nvmlSystemGetDriverVersion)                   \
    X(nvmlSystemGetNVMLVersion)                     \
    X(nvmlDeviceGetCount_v2)                        \
    X(nvmlDeviceGetHandleByIndex_v2)                \
    X(nvmlDeviceGetIndex)                           \
    X(nvmlDeviceGetName)                            \
    X(nvmlDeviceGetUUID)                            \
    X(nvmlDeviceGetPciInfo_v3)                      \
    X(nvmlDeviceGetUtilizationRates)                \
    X(nvmlDeviceGetEncoderUtilization)              \
    X(nvmlDeviceGetDecoderUtilization)              \
    X(nvmlDeviceGetMemoryInfo)                      \
    X(nvmlDeviceGetMemoryInfo_v2)                   \
    X(nvmlDeviceGetTemperature)                     \
    X(nvmlDeviceGetFieldValues)                     \
    X(nvmlDeviceGetPowerUsage)                      \
    X(nvmlDeviceGetEnforcedPowerLimit)              \
    X(nvmlDeviceGetTotalEnergyConsumption)          \
    X(nvmlDeviceGetClockInfo)                       \
    X(nvmlDeviceGetFanSpeed)                        \
    X(nvmlDeviceGetPcieThroughput)                  \
    X(nvmlDeviceGetPerformanceState)                \
    X(nvmlDeviceGetCurrentClocksEventReasons)       \
    X(nvmlDeviceGetCurrentClocksThrottleReasons)    \
    X(nvmlDeviceGetTotalEccErrors)                  \
    X(nvmlDeviceGetNvLinkState)                     \
    X(nvmlDeviceGetNvLinkErrorCounter)              \
    X(nvmlDeviceGetRemappedRows)                    \
    X(nvmlDeviceGetRetiredPages)                    \
    X(nvmlDeviceGetRetiredPagesPendingStatus)       \
    X(nvmlDeviceGetPcieReplayCounter)               \
    X(nvmlDeviceGetViolationStatus)                 \
    X(nvmlDeviceGetComputeRunningProcesses_v3)      \
    X(nvmlDeviceGetGraphicsRunningProcesses_v3)     \
    X(nvmlDeviceGetProcessUtilization)              \
    MIG_FN_LIST(X)                                  \
    X(nvmlEventSetCreate)                           \
    X(nvmlDeviceRegisterEvents)                     \
    X(nvmlDeviceGetSupportedEventTypes)             \
    X(nvmlEventSetWait_v2)                          \
    X(nvmlEventSetFree)                             \
    X(nvmlGpmQueryDeviceSupport)                    \
    X(nvmlGpmSampleAlloc)                           \
    X(nvmlGpmSampleFree)                            \
    X(nvmlGpmSampleGet)                             \
    X(nvmlGpmMigSampleGet)                          \
    X(nvmlGpmMetricsGet)

#define X_ENUM(n) F_##n,
enum fn_id { FN_LIST(X_ENUM) F_COUNT };
#undef X_ENUM
#define X_NAME(n) #n,
static const char *const fn_names[F_COUNT] = {FN_LIST(X_NAME)};
#undef X_NAME

/* The stats file is rewritten (temp file + rename) at most every
 * STATS_PERIOD_MS: a call at least that long after the previous write writes
 * at once; otherwise the counts are marked dirty and a flusher thread writes
 * them when the period is over (a rename over an existing file costs ~0.2 ms
 * on ext4).  So the file is never more than ~STATS_PERIOD_MS behind. */
#define STATS_PERIOD_MS 50

static pthread_mutex_t g_stats_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t g_stats_cond = PTHREAD_COND_INITIALIZER;
static unsigned long long g_calls[F_COUNT];
static char g_stats_path[4096];
static int g_stats_env_read;
static int g_stats_dirty;
static int g_flusher_running;
static long long g_stats_last_ms = -1000000;

static void stats_read_env_locked(void)
{
    const char *p = getenv("FAKE_NVML_STATS");
    if (p && *p && strlen(p) < sizeof(g_stats_path) - 32)
        strcpy(g_stats_path, p);
    else
        g_stats_path[0] = '\0';
    g_stats_env_read = 1;
}

static void stats_write_locked(void)
{
    char tmp[sizeof(g_stats_path) + 64];
    char buf[F_COUNT * 80 + 64];
    size_t len = 0;
    int fd;

    g_stats_dirty = 0;
    g_stats_last_ms = mono_ms();
    if (!g_stats_path[0])
        return;
    len += (size_t)snprintf(buf + len, sizeof(buf) - len, "# pid %ld\n", (long)getpid());
    for (int i = 0; i < F_COUNT; i++) {
        if (g_calls[i])
            len += (size_t)snprintf(buf + len, sizeof(buf) - len, "%s %llu\n", fn_names[i], g_calls[i]);
    }
    snprintf(tmp, sizeof(tmp), "%s.tmp.%ld", g_stats_path, (long)getpid());
    fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0)
        return;
    size_t off = 0;
    while (off < len) {
        ssize_t w = write(fd, buf + off, len - off);
        if (w < 0) {
            if (errno == EINTR)
                continue;
            break;
        }
        off += (size_t)w;
    }
    close(fd);
    if (off == len)
        rename(tmp, g_stats_path);
    else
        unlink(tmp);
}

static void *stats_flusher(void *arg)
{
    (void)arg;
    pthread_mutex_lock(&g_stats_lock);
    for (;;) {
        while (!g_stats_dirty)
            pthread_cond_wait(&g_stats_cond, &g_stats_lock);
        long long wait = g_stats_last_ms + STATS_PERIOD_MS - mono_ms();
        if (wait > 0) {
            pthread_mutex_unlock(&g_stats_lock);
            sleep_ms((unsigned long long)wait);
            pthread_mutex_lock(&g_stats_lock);
            continue;
        }
        stats_write_locked();
    }
    return NULL;
}

/* Start the flusher (signals blocked: it must never run Python's handlers'
 * C part in place of the main thread). Returns 0 when it runs. */
static int stats_start_flusher_locked(void)
{
    pthread_t t;
    pthread_attr_t attr;
    sigset_t all, old;
    int rc;

    if (g_flusher_running)
        return 0;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    rc = pthread_create(&t, &attr, stats_flusher, NULL);
    pthread_attr_destroy(&attr);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (rc == 0)
        g_flusher_running = 1;
    return rc;
}

static void count_call(enum fn_id id)
{
    pthread_mutex_lock(&g_stats_lock);
    if (!g_stats_env_read)
        stats_read_env_locked();
    g_calls[id]++;
    if (g_stats_path[0]) {
        if (mono_ms() - g_stats_last_ms >= STATS_PERIOD_MS || stats_start_flusher_locked() != 0) {
            stats_write_locked();
        } else {
            g_stats_dirty = 1;
            pthread_cond_signal(&g_stats_cond);
        }
    }
    pthread_mutex_unlock(&g_stats_lock);
}

/* Exported for in-process tests (ctypes): calls of `name` in this process. */
EXPORT unsigned long long fakenvml_call_count(const char *name)
{
    unsigned long long n = 0;
    if (!name)
        return 0;
    pthread_mutex_lock(&g_stats_lock);
    for (int i = 0; i < F_COUNT; i++) {
        if (strcmp(fn_names[i], name) == 0)
            n = g_calls[i];
    }
    pthread_mutex_unlock(&g_stats_lock);
    return n;
}

EXPORT void fakenvml_reset_counts(void)
{
    pthread_mutex_lock(&g_stats_lock);
    memset(g_calls, 0, sizeof(g_calls));
    if (g_stats_path[0])
        stats_write_locked();
    pthread_mutex_unlock(&g_stats_lock);
}

/* ------------------------------------------------------------------------ */
/* Configuration                                                            */
/* ------------------------------------------------------------------------ */

#define MAX_GPUS 64
#define LIST_LEN 1024
#define LINK_LIST_LEN 512 /* a value per NVLink: "v0,v1,..." */

enum proc_type { PROC_COMPUTE = 1, PROC_GRAPHICS = 2, PROC_BOTH = 3 };

typedef struct {
    char name[96];
    char uuid[96];
    char pci_bus_id[32];
    unsigned long long pci_device_id;
    unsigned long long pci_subsystem_id;
    unsigned long long utilization_gpu;
    unsigned long long utilization_memory;
    unsigned long long encoder_utilization;
    unsigned long long decoder_utilization;
    unsigned long long memory_total;
    unsigned long long memory_used;
    unsigned long long memory_free;
    unsigned long long memory_reserved;
    unsigned long long memory_v2;
    unsigned long long temperature;
    unsigned long long memory_temperature;
    unsigned long long power_usage;
    unsigned long long power_limit;
    unsigned long long total_energy;
    unsigned long long clock_graphics;
    unsigned long long clock_sm;
    unsigned long long clock_memory;
    unsigned long long clock_video;
    unsigned long long fan_speed;
    unsigned long long pcie_tx;
    unsigned long long pcie_rx;
    unsigned long long performance_state;
    unsigned long long clocks_event_reasons;
    unsigned long long ecc_corrected_volatile;
    unsigned long long ecc_uncorrected_volatile;
    unsigned long long ecc_corrected_aggregate;
    unsigned long long ecc_uncorrected_aggregate;
    unsigned long long supported_event_types;
    unsigned long long gpm_supported;
    char gpm_metrics[LIST_LEN];       /* "metric id:rate,..." (% or MiB/s) */
    char gpm_not_supported[LIST_LEN]; /* metric ids answering NOT_SUPPORTED */
    unsigned long long nvlink_count;
    char nvlink_down[LINK_LIST_LEN];
    char nvlink_tx_kib[LINK_LIST_LEN];
    char nvlink_rx_kib[LINK_LIST_LEN];
    char nvlink_replay[LINK_LIST_LEN];
    char nvlink_recovery[LINK_LIST_LEN];
    char nvlink_crc_flit[LINK_LIST_LEN];
    char nvlink_crc_data[LINK_LIST_LEN];
    unsigned long long remapped_rows_correctable;
    unsigned long long remapped_rows_uncorrectable;
    unsigned long long remapped_rows_pending;
    unsigned long long remapped_rows_failure;
    unsigned long long retired_pages_single_bit;
    unsigned long long retired_pages_double_bit;
    unsigned long long retired_pages_pending;
    unsigned long long pcie_replay_counter;
    unsigned long long violation[NVML_PERF_POLICY_RELIABILITY + 1]; /* ns, by policy */
    unsigned long long lost;
    unsigned long long delay_ms;
    char not_supported[LIST_LEN];
    char errors[LIST_LEN];
} gpu_cfg;

typedef struct {
    int gpu;
    unsigned int pid;
    unsigned long long used_memory;
    unsigned int sm_util, mem_util, enc_util, dec_util;
    int type;
    unsigned long long timestamp_us; /* 0: "now" */
    unsigned int gpu_instance, compute_instance; /* MIG: the instance it runs in */
} proc_cfg;

typedef struct {
    int gpu;
    unsigned long long xid;
} xid_cfg;

struct mig_config;
static void mig_config_free(struct mig_config *m);

typedef struct {
    char driver_version[80];
    char nvml_version[80];
    unsigned int device_count;
    nvmlReturn_t init_error;
    nvmlReturn_t fail_all;
    unsigned long long delay_ms;
    unsigned long long pcie_throughput_ms; /* the window each PCIe throughput call measures */
    char errors[LIST_LEN];
    gpu_cfg gpus[MAX_GPUS];
    proc_cfg *procs;
    size_t nprocs;
    xid_cfg *xids;
    size_t nxids;
    /* Per GPU lost (`lost`, or past a lowered device_count): the xid lines there were when a
     * config first showed it lost; SIZE_MAX while it is not. Set by maybe_reload_locked. */
    size_t lost_at[MAX_GPUS];
    struct mig_config *mig; /* section "MIG" */
} config_t;

static int mig_apply_key(config_t *c, unsigned int gpu, const char *field, const char *val);

enum ftype { T_STR, T_U64, T_BOOL };

typedef struct {
    const char *name;
    enum ftype type;
    size_t offset;
    size_t size; /* for strings */
} field_def;

#define FSTR(n) {#n, T_STR, offsetof(gpu_cfg, n), sizeof(((gpu_cfg *)0)->n)}
#define FU64(n) {#n, T_U64, offsetof(gpu_cfg, n), 0}
#define FBOOL(n) {#n, T_BOOL, offsetof(gpu_cfg, n), 0}
#define FVIOL(key, policy) {key, T_U64, offsetof(gpu_cfg, violation) + (policy) * sizeof(unsigned long long), 0}

static const field_def gpu_fields[] = {
    FSTR(name), FSTR(uuid), FSTR(pci_bus_id),
    FU64(pci_device_id), FU64(pci_subsystem_id),
    FU64(utilization_gpu), FU64(utilization_memory),
    FU64(encoder_utilization), FU64(decoder_utilization),
    FU64(memory_total), FU64(memory_used), FU64(memory_free), FU64(memory_reserved),
    FBOOL(memory_v2),
    FU64(temperature), FU64(memory_temperature),
    FU64(power_usage), FU64(power_limit), FU64(total_energy),
    FU64(clock_graphics), FU64(clock_sm), FU64(clock_memory), FU64(clock_video),
    FU64(fan_speed), FU64(pcie_tx), FU64(pcie_rx),
    FU64(performance_state), FU64(clocks_event_reasons),
    FU64(ecc_corrected_volatile), FU64(ecc_uncorrected_volatile),
    FU64(ecc_corrected_aggregate), FU64(ecc_uncorrected_aggregate),
    FU64(supported_event_types),
    FBOOL(gpm_supported), FSTR(gpm_metrics), FSTR(gpm_not_supported),
    FU64(nvlink_count), FSTR(nvlink_down), FSTR(nvlink_tx_kib), FSTR(nvlink_rx_kib),
    FSTR(nvlink_replay), FSTR(nvlink_recovery), FSTR(nvlink_crc_flit), FSTR(nvlink_crc_data),
    FU64(remapped_rows_correctable), FU64(remapped_rows_uncorrectable),
    FU64(remapped_rows_pending), FU64(remapped_rows_failure),
    FU64(retired_pages_single_bit), FU64(retired_pages_double_bit), FU64(retired_pages_pending),
    FU64(pcie_replay_counter),
    FVIOL("violation_power", 0), FVIOL("violation_thermal", 1), FVIOL("violation_sync_boost", 2),
    FVIOL("violation_board_limit", 3), FVIOL("violation_low_utilization", 4),
    FVIOL("violation_reliability", 5),
    FBOOL(lost), FU64(delay_ms),
    FSTR(not_supported), FSTR(errors),
};

static void copy_str(char *dst, size_t size, const char *src)
{
    size_t n = strlen(src);
    if (n >= size)
        n = size - 1;
    memcpy(dst, src, n);
    dst[n] = '\0';
}

/* Decimal, 0x-hex; a leading '-' wraps like C unsigned arithmetic. */
static unsigned long long parse_u64(const char *s)
{
    while (*s == ' ' || *s == '\t')
        s++;
    if (s[0] == '0' && (s[1] == 'x' || s[1] == 'X'))
        return strtoull(s + 2, NULL, 16);
    return strtoull(s, NULL, 10);
}

static unsigned long long parse_bool(const char *s)
{
    while (*s == ' ' || *s == '\t')
        s++;
    if (!strncasecmp(s, "true", 4) || !strncasecmp(s, "yes", 3) || !strncasecmp(s, "on", 2))
        return 1;
    return parse_u64(s) != 0;
}

static void gpu_defaults(gpu_cfg *g, unsigned int i)
{
    memset(g, 0, sizeof(*g));
    copy_str(g->name, sizeof(g->name), "NVIDIA Fake A100");
    snprintf(g->uuid, sizeof(g->uuid), "GPU-fa4e0000-0000-4000-8000-%012x", i);
    snprintf(g->pci_bus_id, sizeof(g->pci_bus_id), "00000000:%02X:00.0", (0x10 + i) & 0xff);
    g->pci_device_id = 0x20B010DEull;
    g->pci_subsystem_id = 0x134F10DEull;
    g->utilization_gpu = 50;
    g->utilization_memory = 30;
    g->memory_total = 85899345920ull;  /* 80 GiB */
    g->memory_reserved = 536870912ull; /* 512 MiB */
    g->memory_used = 10737418240ull;   /* 10 GiB */
    g->memory_free = g->memory_total - g->memory_reserved - g->memory_used;
    g->memory_v2 = 1;
    g->temperature = 60;
    g->memory_temperature = 70;
    g->power_usage = 250000;            /* mW */
    g->power_limit = 400000;            /* mW */
    g->total_energy = 1000000000ull;    /* mJ */
    g->clock_graphics = 1410;
    g->clock_sm = 1410;
    g->clock_memory = 1593;
    g->clock_video = 1275;
    g->fan_speed = 40;
    g->pcie_tx = 1000; /* KB/s */
    g->pcie_rx = 2000;
    g->performance_state = 0;
    g->supported_event_types = 0x1F; /* SBE|DBE|PState|Xid|Clock */
}

static gpu_cfg g_default_gpus[MAX_GPUS];
static pthread_once_t g_defaults_once = PTHREAD_ONCE_INIT;

static void init_defaults(void)
{
    for (unsigned int i = 0; i < MAX_GPUS; i++)
        gpu_defaults(&g_default_gpus[i], i);
}

static void config_free(config_t *c)
{
    if (!c)
        return;
    free(c->procs);
    free(c->xids);
    mig_config_free(c->mig);
    free(c);
}

/* "pid,used_memory,sm,mem,enc,dec,type[,timestamp_us]" */
static int parse_process(const char *v, int gpu, proc_cfg *p)
{
    char buf[512];
    char *save = NULL, *tok;
    int col = 0;

    memset(p, 0, sizeof(*p));
    p->gpu = gpu;
    p->type = PROC_COMPUTE;
    p->gpu_instance = p->compute_instance = NVML_NO_INSTANCE;
    copy_str(buf, sizeof(buf), v);
    for (tok = strtok_r(buf, ",", &save); tok; tok = strtok_r(NULL, ",", &save), col++) {
        while (*tok == ' ')
            tok++;
        switch (col) {
        case 0: p->pid = (unsigned int)parse_u64(tok); break;
        case 1: p->used_memory = parse_u64(tok); break;
        case 2: p->sm_util = (unsigned int)parse_u64(tok); break;
        case 3: p->mem_util = (unsigned int)parse_u64(tok); break;
        case 4: p->enc_util = (unsigned int)parse_u64(tok); break;
        case 5: p->dec_util = (unsigned int)parse_u64(tok); break;
        case 6:
            if (!strncasecmp(tok, "graphics", 8))
                p->type = PROC_GRAPHICS;
            else if (!strncasecmp(tok, "both", 4) || !strncasecmp(tok, "compute+graphics", 16))
                p->type = PROC_BOTH;
            else
                p->type = PROC_COMPUTE;
            break;
        case 7: p->timestamp_us = parse_u64(tok); break;
        case 8: p->gpu_instance = (unsigned int)parse_u64(tok); break;
        case 9: p->compute_instance = (unsigned int)parse_u64(tok); break;
        default: break;
        }
    }
    return col > 0;
}

static int push(void **arr, size_t *n, size_t *cap, size_t elsize, const void *el)
{
    if (*n == *cap) {
        size_t nc = *cap ? *cap * 2 : 16;
        void *p = realloc(*arr, nc * elsize);
        if (!p)
            return -1;
        *arr = p;
        *cap = nc;
    }
    memcpy((char *)*arr + *n * elsize, el, elsize);
    (*n)++;
    return 0;
}

static void apply_gpu_key(config_t *c, unsigned int idx, const char *field, const char *val,
                          size_t *proc_cap)
{
    gpu_cfg *g = &c->gpus[idx];
    if (mig_apply_key(c, idx, field, val))
        return;
    if (!strcmp(field, "process")) {
        proc_cfg p;
        if (parse_process(val, (int)idx, &p))
            push((void **)&c->procs, &c->nprocs, proc_cap, sizeof(p), &p);
        return;
    }
    for (size_t i = 0; i < sizeof(gpu_fields) / sizeof(gpu_fields[0]); i++) {
        const field_def *f = &gpu_fields[i];
        if (strcmp(f->name, field))
            continue;
        char *dst = (char *)g + f->offset;
        switch (f->type) {
        case T_STR: copy_str(dst, f->size, val); break;
        case T_U64: *(unsigned long long *)dst = parse_u64(val); break;
        case T_BOOL: *(unsigned long long *)dst = parse_bool(val); break;
        }
        return;
    }
    /* unknown keys are ignored (forward compatible) */
}

/* Parse a whole config text (NUL-terminated, modified in place). */
static config_t *config_parse(char *text)
{
    config_t *c = calloc(1, sizeof(*c));
    size_t proc_cap = 0, xid_cap = 0;
    int max_gpu = -1, have_count = 0;
    char *save = NULL, *line;

    if (!c)
        return NULL;
    pthread_once(&g_defaults_once, init_defaults);
    memcpy(c->gpus, g_default_gpus, sizeof(c->gpus));
    copy_str(c->driver_version, sizeof(c->driver_version), "550.54.15");
    copy_str(c->nvml_version, sizeof(c->nvml_version), "12.550.54.15");

    for (line = strtok_r(text, "\n", &save); line; line = strtok_r(NULL, "\n", &save)) {
        size_t len = strlen(line);
        if (len && line[len - 1] == '\r')
            line[--len] = '\0';
        while (*line == ' ' || *line == '\t')
            line++;
        if (!*line || *line == '#')
            continue;
        char *eq = strchr(line, '=');
        if (!eq)
            continue;
        *eq = '\0';
        const char *key = line, *val = eq + 1;
        char *kend = eq;
        while (kend > line && (kend[-1] == ' ' || kend[-1] == '\t'))
            *--kend = '\0';

        if (!strncmp(key, "gpu.", 4)) {
            char *end = NULL;
            unsigned long idx = strtoul(key + 4, &end, 10);
            if (!end || end == key + 4 || *end != '.' || idx >= MAX_GPUS)
                continue;
            if ((int)idx > max_gpu)
                max_gpu = (int)idx;
            apply_gpu_key(c, (unsigned int)idx, end + 1, val, &proc_cap);
        } else if (!strcmp(key, "xid")) {
            xid_cfg x;
            char *end = NULL;
            x.gpu = (int)strtol(val, &end, 10);
            if (!end || *end != ',')
                continue;
            x.xid = parse_u64(end + 1);
            push((void **)&c->xids, &c->nxids, &xid_cap, sizeof(x), &x);
        } else if (!strcmp(key, "driver_version")) {
            copy_str(c->driver_version, sizeof(c->driver_version), val);
        } else if (!strcmp(key, "nvml_version")) {
            copy_str(c->nvml_version, sizeof(c->nvml_version), val);
        } else if (!strcmp(key, "device_count")) {
            unsigned long long n = parse_u64(val);
            c->device_count = n > MAX_GPUS ? MAX_GPUS : (unsigned int)n;
            have_count = 1;
        } else if (!strcmp(key, "init_error")) {
            c->init_error = (nvmlReturn_t)parse_u64(val);
        } else if (!strcmp(key, "fail_all")) {
            c->fail_all = (nvmlReturn_t)parse_u64(val);
        } else if (!strcmp(key, "delay_ms")) {
            c->delay_ms = parse_u64(val);
        } else if (!strcmp(key, "pcie_throughput_ms")) {
            c->pcie_throughput_ms = parse_u64(val);
        } else if (!strcmp(key, "errors")) {
            copy_str(c->errors, sizeof(c->errors), val);
        }
    }
    if (!have_count)
        c->device_count = (unsigned int)(max_gpu + 1);
    return c;
}

static char *read_file(const char *path)
{
    FILE *f = fopen(path, "re");
    char *buf = NULL;
    size_t len = 0, cap = 0;

    if (!f)
        return NULL;
    for (;;) {
        if (cap - len < 4096) {
            size_t nc = cap ? cap * 2 : 8192;
            char *p = realloc(buf, nc);
            if (!p) {
                free(buf);
                fclose(f);
                return NULL;
            }
            buf = p;
            cap = nc;
        }
        size_t r = fread(buf + len, 1, cap - len - 1, f);
        len += r;
        if (r == 0)
            break;
    }
    int err = ferror(f);
    fclose(f);
    if (err) {
        free(buf);
        return NULL;
    }
    buf[len] = '\0';
    return buf;
}

/* ------------------------------------------------------------------------ */
/* Global state (all guarded by g_lock)                                     */
/* ------------------------------------------------------------------------ */

struct fake_device {
    unsigned int magic;
    unsigned int index;
};

#define DEVICE_MAGIC 0xFA4E0D00u
#define SET_MAGIC 0xFA4E5E70u
#define MAX_SETS 256

struct fake_event_set {
    unsigned int magic;
    size_t cursor; /* index of the next xid line to consider */
    unsigned long long mask[MAX_GPUS];
};

static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static struct fake_device g_dev[MAX_GPUS];
static struct fake_event_set *g_sets[MAX_SETS];
static config_t *g_cfg;
static char *g_cfg_text; /* the text g_cfg was parsed from */
static int g_refcount;
static char g_cfg_path[4096];

static struct {
    int valid;
    dev_t dev;
    ino_t ino;
    off_t size;
    struct timespec mtime;
    struct timespec loaded_at;
} g_key;

#define RACY_NS 1000000000LL /* files younger than this at load time are re-read */

/* fork() safety: no lock is held across fork, and the child (which has no
 * flusher thread) starts its own when it needs one. */
static void atfork_prepare(void)
{
    pthread_mutex_lock(&g_lock);
    pthread_mutex_lock(&g_stats_lock);
}

static void atfork_parent(void)
{
    pthread_mutex_unlock(&g_stats_lock);
    pthread_mutex_unlock(&g_lock);
}

static void atfork_child(void)
{
    g_flusher_running = 0;
    pthread_cond_init(&g_stats_cond, NULL); /* forget the parent's flusher */
    pthread_mutex_unlock(&g_stats_lock);
    pthread_mutex_unlock(&g_lock);
}

__attribute__((constructor)) static void fakenvml_load(void)
{
    pthread_atfork(atfork_prepare, atfork_parent, atfork_child);
}

/* At exit (or dlclose) write counts the flusher has not written yet. */
__attribute__((destructor)) static void fakenvml_unload(void)
{
    pthread_mutex_lock(&g_stats_lock);
    if (g_stats_dirty)
        stats_write_locked();
    pthread_mutex_unlock(&g_stats_lock);
}

/* Re-read the config when it changed. force: always re-read.
 * Returns 0 when a config is loaded (new or kept), -1 when none could be read. */
/* c->lost_at from the config it replaces (NULL: none): a GPU lost in both keeps its line. */
static void mark_lost(config_t *c, const config_t *old)
{
    for (unsigned int i = 0; i < MAX_GPUS; i++) {
        if (i < c->device_count && !c->gpus[i].lost)
            c->lost_at[i] = SIZE_MAX;
        else if (old && old->lost_at[i] < c->nxids)
            c->lost_at[i] = old->lost_at[i];
        else
            c->lost_at[i] = c->nxids;
    }
}

static int maybe_reload_locked(int force)
{
    struct stat st;
    if (!g_cfg_path[0])
        return g_cfg ? 0 : -1;
    if (stat(g_cfg_path, &st) != 0)
        return (g_cfg && !force) ? 0 : -1; /* keep the last good config */
    if (!force && g_cfg && g_key.valid && st.st_dev == g_key.dev && st.st_ino == g_key.ino &&
        st.st_size == g_key.size && st.st_mtim.tv_sec == g_key.mtime.tv_sec &&
        st.st_mtim.tv_nsec == g_key.mtime.tv_nsec &&
        ts_diff_ns(&g_key.loaded_at, &g_key.mtime) >= RACY_NS)
        return 0;

    char *text = read_file(g_cfg_path);
    if (!text)
        return (g_cfg && !force) ? 0 : -1;
    if (g_cfg && g_cfg_text && !strcmp(text, g_cfg_text)) {
        free(text); /* unchanged (a young file re-checked): keep the parsed config */
    } else {
        char *copy = strdup(text);
        config_t *c = config_parse(text); /* parses in place */
        free(text);
        if (!c || !copy) {
            free(copy);
            config_free(c);
            return (g_cfg && !force) ? 0 : -1;
        }
        mark_lost(c, g_cfg);
        config_free(g_cfg);
        g_cfg = c;
        free(g_cfg_text);
        g_cfg_text = copy;
    }
    g_key.valid = 1;
    g_key.dev = st.st_dev;
    g_key.ino = st.st_ino;
    g_key.size = st.st_size;
    g_key.mtime = st.st_mtim;
    clock_gettime(CLOCK_REALTIME, &g_key.loaded_at);
    return 0;
}

static int device_index(nvmlDevice_t d)
{
    uintptr_t p = (uintptr_t)d, base = (uintptr_t)&g_dev[0];
    if (!d || p < base || p >= base + sizeof(g_dev) || (p - base) % sizeof(g_dev[0]))
        return -1;
    if (d->magic != DEVICE_MAGIC)
        return -1;
    return (int)d->index;
}

static int set_valid(nvmlEventSet_t s)
{
    if (!s)
        return 0;
    for (int i = 0; i < MAX_SETS; i++)
        if (g_sets[i] == s)
            return s->magic == SET_MAGIC;
    return 0;
}

/* Is `name` one of the comma-separated tokens of `aliases`? */
static int name_in(const char *aliases, const char *name, size_t nlen)
{
    const char *a = aliases;
    while (a && *a) {
        const char *e = strchr(a, ',');
        size_t l = e ? (size_t)(e - a) : strlen(a);
        if (l == nlen && !strncmp(a, name, nlen))
            return 1;
        a = e ? e + 1 : NULL;
    }
    return 0;
}

/* Search a "name[:code],name[:code]" list for the function name or any alias; the name `*`
 * matches every function. Returns the code (default_code when a token has no ":code"), 0 if
 * absent. */
static nvmlReturn_t list_lookup(const char *list, const char *fname, const char *aliases,
                                nvmlReturn_t default_code)
{
    const char *t = list;
    while (t && *t) {
        const char *e = strchr(t, ',');
        size_t l = e ? (size_t)(e - t) : strlen(t);
        const char *colon = memchr(t, ':', l);
        size_t nl = colon ? (size_t)(colon - t) : l;
        const char *n = t;
        while (nl && (*n == ' ' || *n == '\t')) {
            n++;
            nl--;
        }
        while (nl && (n[nl - 1] == ' ' || n[nl - 1] == '\t'))
            nl--;
        if (nl && ((nl == 1 && *n == '*') || (strlen(fname) == nl && !strncmp(fname, n, nl)) ||
                   name_in(aliases, n, nl))) {
            if (colon)
                return (nvmlReturn_t)strtol(colon + 1, NULL, 0);
            return default_code;
        }
        t = e ? e + 1 : NULL;
    }
    return 0;
}

/* Error injected for this device and field (errors wins over not_supported). */
static nvmlReturn_t gpu_field_rc(const gpu_cfg *g, const char *fname, const char *aliases)
{
    nvmlReturn_t rc = list_lookup(g->errors, fname, aliases, NVML_ERROR_UNKNOWN);
    if (rc)
        return rc;
    return list_lookup(g->not_supported, fname, aliases, NVML_ERROR_NOT_SUPPORTED);
}

/* ------------------------------------------------------------------------ */
/* Call prologue / epilogue                                                 */
/* ------------------------------------------------------------------------ */

typedef struct {
    nvmlReturn_t rc;
    unsigned long long delay_ms;
    const config_t *cfg;
    const gpu_cfg *gpu;
    int idx;
} call_t;

/* Counts the call, takes g_lock (always; release with leave()), reloads the
 * config and decides the injected error. With need_device, validates `d`. */
static call_t enter(enum fn_id id, int need_device, nvmlDevice_t d, const char *aliases)
{
    call_t c = {0, 0, NULL, NULL, -1};
    count_call(id);
    pthread_mutex_lock(&g_lock);
    if (g_refcount <= 0) {
        c.rc = NVML_ERROR_UNINITIALIZED;
        return c;
    }
    if (maybe_reload_locked(0) != 0 || !g_cfg) {
        c.rc = NVML_ERROR_UNINITIALIZED;
        return c;
    }
    c.cfg = g_cfg;
    c.delay_ms = g_cfg->delay_ms;
    if (g_cfg->fail_all) {
        c.rc = g_cfg->fail_all;
        return c;
    }
    c.rc = list_lookup(g_cfg->errors, fn_names[id], "", NVML_ERROR_UNKNOWN);
    if (c.rc || !need_device)
        return c;
    c.idx = device_index(d);
    if (c.idx < 0) {
        c.rc = NVML_ERROR_INVALID_ARGUMENT;
        return c;
    }
    if ((unsigned int)c.idx >= g_cfg->device_count) {
        c.rc = NVML_ERROR_GPU_IS_LOST; /* the device went away */
        return c;
    }
    c.gpu = &g_cfg->gpus[c.idx];
    c.delay_ms += c.gpu->delay_ms;
    if (c.gpu->lost) {
        c.rc = NVML_ERROR_GPU_IS_LOST;
        return c;
    }
    c.rc = gpu_field_rc(c.gpu, fn_names[id], aliases ? aliases : "");
    return c;
}

static nvmlReturn_t leave(call_t *c)
{
    pthread_mutex_unlock(&g_lock);
    sleep_ms(c->delay_ms);
    return c->rc;
}

#define DEV_ENTER(fn, dev, aliases) call_t c = enter(F_##fn, 1, (dev), (aliases))
#define SYS_ENTER(fn) call_t c = enter(F_##fn, 0, NULL, "")

static nvmlReturn_t copy_out_str(char *dst, unsigned int length, const char *src)
{
    size_t n = strlen(src);
    if (!dst)
        return NVML_ERROR_INVALID_ARGUMENT;
    if ((size_t)length < n + 1)
        return NVML_ERROR_INSUFFICIENT_SIZE;
    memcpy(dst, src, n + 1);
    return NVML_SUCCESS;
}

/* ------------------------------------------------------------------------ */
/* Init / shutdown / errors / system                                        */
/* ------------------------------------------------------------------------ */

static nvmlReturn_t do_init(void)
{
    nvmlReturn_t rc;
    unsigned long long delay = 0;

    pthread_mutex_lock(&g_stats_lock);
    stats_read_env_locked();
    pthread_mutex_unlock(&g_stats_lock);

    pthread_mutex_lock(&g_lock);
    for (unsigned int i = 0; i < MAX_GPUS; i++) {
        g_dev[i].magic = DEVICE_MAGIC;
        g_dev[i].index = i;
    }
    const char *p = getenv("FAKE_NVML_CONFIG");
    if (p && *p && strlen(p) < sizeof(g_cfg_path))
        strcpy(g_cfg_path, p);
    else
        g_cfg_path[0] = '\0';
    if (!g_cfg_path[0] || maybe_reload_locked(1) != 0) {
        rc = NVML_ERROR_DRIVER_NOT_LOADED; /* no config: "no kernel module" */
    } else {
        delay = g_cfg->delay_ms;
        rc = g_cfg->init_error;
        if (!rc)
            g_refcount++;
    }
    pthread_mutex_unlock(&g_lock);
    sleep_ms(delay);
    return rc;
}

EXPORT nvmlReturn_t nvmlInitWithFlags(unsigned int flags)
{
    (void)flags;
    count_call(F_nvmlInitWithFlags);
    return do_init();
}

EXPORT nvmlReturn_t nvmlInit_v2(void)
{
    count_call(F_nvmlInit_v2);
    return do_init();
}

EXPORT nvmlReturn_t nvmlShutdown(void)
{
    nvmlReturn_t rc = NVML_SUCCESS;
    unsigned long long delay = 0;
    count_call(F_nvmlShutdown);
    pthread_mutex_lock(&g_lock);
    if (g_refcount <= 0) {
        rc = NVML_ERROR_UNINITIALIZED;
    } else {
        g_refcount--;
        if (g_cfg)
            delay = g_cfg->delay_ms;
    }
    pthread_mutex_unlock(&g_lock);
    sleep_ms(delay);
    return rc;
}

EXPORT const char *nvmlErrorString(nvmlReturn_t result)
{
    count_call(F_nvmlErrorString);
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
    case 11: return "Interrupt Request Issue";
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
    case 22: return "The requested vgpu operation is not available on target device, becasue ECC is enabled";
    case 23: return "Insufficient resources";
    case 24: return "Frequency not supported";
    case 25: return "Argument version mismatch";
    case 26: return "Deprecated";
    case 27: return "Not ready";
    case 28: return "GPU not found";
    case 29: return "Invalid state";
    default: return "Unknown Error";
    }
}

EXPORT nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length)
{
    SYS_ENTER(nvmlSystemGetDriverVersion);
    if (!c.rc)
        c.rc = copy_out_str(version, length, c.cfg->driver_version);
    return leave(&c);
}

EXPORT nvmlReturn_t nvmlSystemGetNVMLVersion(char *version, unsigned int length)
{
    SYS_ENTER(nvmlSystemGetNVMLVersion);
    if (!c.rc)
        c.rc = copy_out_str(version, length, c.cfg->nvml_version);
    return leave(&c);
}

/* The MIG section (at the end) answers these calls for MIG device handles. */
static int is_mig_handle(nvmlDevice_t d);
static int mig_enabled(const config_t *cfg, int gpu);
static nvmlReturn_t mig_uuid(nvmlDevice_t d, char *uuid, unsigned int length);
static nvmlReturn_t mig_memory(nvmlDevice_t d, nvmlMemory_t *m);
static nvmlReturn_t mig_compute_processes(nvmlDevice_t d, unsigned int *count,
                                          nvmlProcessInfo_t *infos);

/* ------------------------------------------------------------------------ */
/* Devices                                                                  */
/* ------------------------------------------------------------------------ */

EXPORT nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *deviceCount)
{
    SYS_ENTER(nvmlDeviceGetCount_v2);
    if (!c.rc) {
        if (!deviceCount)
            c.rc = NVML_ERROR_INVALID_ARGUMENT;
        else
            *deviceCount = c.cfg->device_count;
    }
    return leave(&c);
}

EXPORT nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device)
{
    SYS_ENTER(nvmlDeviceGetHandleByIndex_v2);
    if (!c.rc) {
        if (!device || index >= c.cfg->device_count) {
            c.rc = NVML_ERROR_INVALID_ARGUMENT;
        } else {
            const gpu_cfg *g = &c.cfg->gpus[index];
            c.delay_ms += g->delay_ms;
            if (g->lost)
                c.rc = NVML_ERROR_GPU_IS_LOST;
            else
                c.rc = gpu_field_rc(g, "nvmlDeviceGetHandleByIndex_v2", "handle");
            if (!c.rc)
                *device = &g_dev[index];
        }
    }
    return leave(&c);
}

EXPORT nvmlReturn_t nvmlDeviceGetIndex(nvmlDevice_t device, unsigned int *index)
{
    DEV_ENTER(nvmlDeviceGetIndex, device, "index");
    if (!c.rc) {
        if (!index)
            c.rc = NVML_ERROR_INVALID_ARGUMENT;
        else
            *index = (unsigned int)c.idx;
    }
    return leave(&c);
}

EXPORT nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t device, char *name, unsigned int length)
{
    DEV_ENTER(nvmlDeviceGetName, device, "name");
    if (!c.rc)
        c.rc = copy_out_str(name, length, c.gpu->name);
    return leave(&c);
}

EXPORT nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t device, char *uuid, unsigned int length)
{
    if (is_mig_handle(device))
        return mig_uuid(device, uuid, length);
    DEV_ENTER(nvmlDeviceGetUUID, device, "uuid");
    if (!c.rc)
        c.rc = copy_out_str(uuid, length, c.gpu->uuid);
    return leave(&c);
}

EXPORT nvmlReturn_t nvmlDeviceGetPciInfo_v3(nvmlDevice_t device, nvmlPciInfo_t *pci)
{
    DEV_ENTER(nvmlDeviceGetPciInfo_v3, device, "pci_bus_id,pci_info");
    if (!c.rc) {
        if (!pci) {
            c.rc = NVML_ERROR_INVALID_ARGUMENT;
        } else {
            unsigned int dom = 0, bus = 0, dev = 0, fn = 0;
            memset(pci, 0, sizeof(*pci));
            copy_str(pci->busId, sizeof(pci->busId), c.gpu->pci_bus_id);
            if (sscanf(c.gpu->pci_bus_id, "%x:%x:%x.%x", &dom, &bus, &dev, &fn) == 4) {
                snprintf(pci->busIdLegacy, sizeof(pci->busIdLegacy), "%04X:%02X:%02X.%X",
                         dom & 0xffffu, bus & 0xffu, dev & 0xffu, fn & 0xfu);
            } else {
                copy_str(pci->busIdLegacy, sizeof(pci->busIdLegacy), c.gpu->pci_bus_id);
            }
            pci->domain = dom;
            pci->bus = bus;
            pci->device = dev;
            pci->pciDeviceId = (unsigned int)c.gpu->pci_device_id;
            pci->pciSubSystemId = (unsigned int)c.gpu->pci_subsystem_id;
        }
    }
    return leave(&c);
}

EXPORT nvmlReturn_t nvmlDeviceGetUtilizationRates(nvmlDevice_t device, nvmlUtilization_t *u)
{
    DEV_ENTER(nvmlDeviceGetUtilizationRates, device, "utilization,utilization_gpu,utilization_memory");
    if (!c.rc && mig_enabled(c.cfg, c.idx))
        c.rc = NVML_ERROR_NOT_SUPPORTED; /* as on a real GPU in MIG mode */
    if (!c.rc) {
        if (!u) {
            c.rc = NVML_ERROR_INVALID_ARGUMENT;
        } else {
            u->gpu = (unsigned int)c.gpu->utilization_gpu;
            u->memory = (unsigned int)c.gpu->utilization_memory;
        }
    }
    return leave(&c);
}

#define SAMPLING_PERIOD_US 167000u

EXPORT nvmlReturn_t nvmlDeviceGetEncoderUtilization(nvmlDevice_t device, unsigned int *util,
                                                    unsigned int *samplingPeriodUs)
{
    DEV_ENTER(nvmlDeviceGetEncoderUtilization, device, "encoder_utilization");
    if (!c.rc) {
        if (!util || !samplingPeriodUs) {
            c.rc = NVML_ERROR_INVALID_ARGUMENT;
        } else {
            *util = (unsigned int)c.gpu->encoder_utilization;
            *samplingPeriodUs = SAMPLING_PERIOD_US;
        }
    }
    return leave(&c);
}

EXPORT nvmlReturn_t nvmlDeviceGetDecoderUtilization(nvmlDevice_t device, unsigned int *util,
                                                    unsigned int *samplingPeriodUs)
{
    DEV_ENTER(nvmlDeviceGetDecoderUtilization, device, "decoder_utilization");
    if (!c.rc) {
        if (!util || !samplingPeriodUs) {
            c.rc = NVML_ERROR_INVALID_ARGUMENT;
        } else {
            *util = (unsigned int)c.gpu->decoder_utilization;
            *samplingPeriodUs = SAMPLING_PERIOD_US;
        }
    }
    return leave(&c);
}

#define MEMORY_ALIASES "memory,memory_total,memory_used,memory_free,memory_reserved"

EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *m)
{
    if (is_mig_handle(device))
        return mig_memory(device, m);
    DEV_ENTER(nvmlDeviceGetMemoryInfo, device, MEMORY_ALIASES);
    if (!c.rc) {
        if (!m) {
            c.rc = NVML_ERROR_INVALID_ARGUMENT;
        } else {
            m->total = c.gpu->memory_total;
            m->free = c.gpu->memory_free;
            m->used = c.gpu->memory_used;
        }
    }
    return leave(&c);
}

EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t device, nvmlMemory_v2_t *m)
{
    DEV_ENTER(nvmlDeviceGetMemoryInfo_v2, device, MEMORY_ALIASES);
    if (!c.rc) {
        if (!c.gpu->memory_v2) {
            c.rc = NVML_ERROR_NOT_SUPPORTED;
        } else if (!m) {
            c.rc = NVML_ERROR_INVALID_ARGUMENT;
        } else if (m->version != NVML_MEMORY_V2_VERSION) {
            c.rc = NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
        } else {
            m->total = c.gpu->memory_total;
            m->reserved = c.gpu->memory_reserved;
            m->free = c.gpu->memory_free;
            m->used = c.gpu->memory_used;
        }
    }
    return leave(&c);
}

EXPORT nvmlReturn_t nvmlDeviceGetTemperature(nvmlDevice_t device, unsigned int sensorType,
                                             unsigned int *temp)
{
    DEV_ENTER(nvmlDeviceGetTemperature, device, "temperature");
    if (!c.rc) {
        if (!temp || sensorType != 0)
            c.rc = NVML_ERROR_INVALID_ARGUMENT;
        else
            *temp = (unsigned int)c.gpu->temperature;
    }
    return leave(&c);
}

/* ------------------------------------------------------------------------ */
/* NVLink                                                                   */
/* ------------------------------------------------------------------------ */

/* The `link`-th number of a "v0,v1,..." list; 0 where the list is shorter. */
static unsigned long long link_value(const char *list, unsigned int link)
{
    const char *p = list;
    for (unsigned int k = 0; k < link && p; k++) {
        p = strchr(p, ',');
        if (p)
            p++;
    }
    return (p && *p && *p != ',') ? parse_u64(p) : 0;
}

/* Is `link` one of the numbers of a "1,3" list? */
static int link_listed(const char *list, unsigned int link)
{
    for (const char *p = list; p && *p; p = strchr(p, ',') ? strchr(p, ',') + 1 : NULL) {
        if (*p != ',' && parse_u64(p) == link)
            return 1;
    }
    return 0;
}

/* A GPU without NVLinks cannot report them; a link beyond its count is a bad argument. */
static nvmlReturn_t nvlink_rc(const gpu_cfg *g, unsigned int link, const char *aliases)
{
    if (!g->nvlink_count)
        return NVML_ERROR_NOT_SUPPORTED;
    if (link >= g->nvlink_count)
        return NVML_ERROR_INVALID_ARGUMENT;
    return gpu_field_rc(g, "", aliases);
}

EXPORT nvmlReturn_t nvmlDeviceGetNvLinkState(nvmlDevice_t device, unsigned int link,
                                             unsigned int *isActive)
{
    DEV_ENTER(nvmlDeviceGetNvLinkState, device, "nvlink,nvlink_state");
    if (!c.rc)
        c.rc = isActive ? nvlink_rc(c.gpu, link, "") : NVML_ERROR_INVALID_ARGUMENT;
    if (!c.rc)
        *isActive = !link_listed(c.gpu->nvlink_down, link);
    return leave(&c);
}

EXPORT nvmlReturn_t nvmlDeviceGetNvLinkErrorCounter(nvmlDevice_t device, unsigned int link,
                                                    unsigned int counter,
                                                    unsigned long long *value)
{
    static const char *const aliases[] = {
        "nvlink,nvlink_errors,nvlink_replay", "nvlink,nvlink_errors,nvlink_recovery",
        "nvlink,nvlink_errors,nvlink_crc_flit", "nvlink,nvlink_errors,nvlink_crc_data"};
    DEV_ENTER(nvmlDeviceGetNvLinkErrorCounter, device,
              counter < NVML_NVLINK_ERROR_DL_ECC_DATA ? aliases[counter] : "nvlink,nvlink_errors");
    if (!c.rc) {
        if (!value || counter > NVML_NVLINK_ERROR_DL_ECC_DATA)
            c.rc = NVML_ERROR_INVALID_ARGUMENT;
        else if (counter == NVML_NVLINK_ERROR_DL_ECC_DATA) /* Hopper and newer only */
            c.rc = NVML_ERROR_NOT_SUPPORTED;
        else
            c.rc = nvlink_rc(c.gpu, link, "");
    }
    if (!c.rc) {
        const char *const lists[] = {c.gpu->nvlink_replay, c.gpu->nvlink_recovery,
                                     c.gpu->nvlink_crc_flit, c.gpu->nvlink_crc_data};
        *value = link_value(lists[counter], link);
    }
    return leave(&c);
}

EXPORT nvmlReturn_t nvmlDeviceGetFieldValues(nvmlDevice_t device, int valuesCount,
                                             nvmlFieldValue_t *values)
{
    DEV_ENTER(nvmlDeviceGetFieldValues, device, "field_values");
    if (!c.rc) {
        if (valuesCount < 0 || (valuesCount > 0 && !values)) {
            c.rc = NVML_ERROR_INVALID_ARGUMENT;
        } else {
            long long ts = (long long)now_us();
            for (int i = 0; i < valuesCount; i++) {
                nvmlFieldValue_t *v = &values[i];
                v->timestamp = ts;
                v->latencyUsec = 0;
                v->value.ullVal = 0;
                v->valueType = NVML_VALUE_TYPE_UNSIGNED_INT;
                if (v->fieldId == NVML_FI_DEV_MEMORY_TEMP) {
                    v->nvmlReturn = gpu_field_rc(c.gpu, "", "memory_temperature");
                    if (!v->nvmlReturn)
                        v->value.uiVal = (unsigned int)c.gpu->memory_temperature;
                } else if (v->fieldId == NVML_FI_DEV_NVLINK_LINK_COUNT) {
                    v->nvmlReturn = nvlink_rc(c.gpu, 0, "nvlink,nvlink_count");
                    if (!v->nvmlReturn)
                        v->value.uiVal = (unsigned int)c.gpu->nvlink_count;
                } else if (v->fieldId == NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX ||
                           v->fieldId == NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX) {
                    int tx = v->fieldId == NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX;
                    v->nvmlReturn = nvlink_rc(c.gpu, v->scopeId,
                                              tx ? "nvlink,nvlink_throughput,nvlink_tx_kib"
                                                 : "nvlink,nvlink_throughput,nvlink_rx_kib");
                    v->valueType = NVML_VALUE_TYPE_UNSIGNED_LONG_LONG;
                    if (!v->nvmlReturn)
                        v->value.ullVal =
                            link_value(tx ? c.gpu->nvlink_tx_kib : c.gpu->nvlink_rx_kib, v->scopeId);
                } else {
                    v->nvmlReturn = NVML_ERROR_NOT_SUPPORTED;
                }
            }
        }
    }
    return leave(&c);
}

EXPORT nvmlReturn_t nvmlDeviceGetPowerUsage(nvmlDevice_t device, unsigned int *power)
{
    DEV_ENTER(nvmlDeviceGetPowerUsage, device, "power_usage");
    if (!c.rc) {
        if (!power)
            c.rc = NVML_ERROR_INVALID_ARGUMENT;
        else
            *power = (unsigned int)c.gpu->power_usage;
    }
    return leave(&c);
}

EXPORT nvmlReturn_t nvmlDeviceGetEnforcedPowerLimit(nvmlDevice_t device, unsigned int *limit)
{
    DEV_ENTER(nvmlDeviceGetEnforcedPowerLimit, device, "power_limit");
    if (!c.rc) {
        if (!limit)
            c.rc = NVML_ERROR_INVALID_ARGUMENT;
        else
            *limit = (unsigned int)c.gpu->power_limit;
    }
    return leave(&c);
}

EXPORT nvmlReturn_t nvmlDeviceGetTotalEnergyConsumption(nvmlDevice_t device,
                                                        unsigned long long *energy)
{
    DEV_ENTER(nvmlDeviceGetTotalEnergyConsumption, device, "total_energy");
    if (!c.rc) {
        if (!energy)
            c.rc = NVML_ERROR_INVALID_ARGUMENT;
        else
            *energy = c.gpu->total_energy;
    }
    return leave(&c);
}

EXPORT nvmlReturn_t nvmlDeviceGetClockInfo(nvmlDevice_t device, unsigned int type,
                                           unsigned int *clock)
{
    static const char *const aliases[] = {
        "clocks,clock_graphics", "clocks,clock_sm", "clocks,clock_memory", "clocks,clock_video"};
    DEV_ENTER(nvmlDeviceGetClockInfo, device, type < 4 ? aliases[type] : "clocks");
    if (!c.rc) {
        if (!clock || type > 3) {
            c.rc = NVML_ERROR_INVALID_ARGUMENT;
        } else {
            const unsigned long long v[4] = {c.gpu->clock_graphics, c.gpu->clock_sm,
                                             c.gpu->clock_memory, c.gpu->clock_video};
            *clock = (unsigned int)v[type];
        }
    }
    return leave(&c);
}

EXPORT nvmlReturn_t nvmlDeviceGetFanSpeed(nvmlDevice_t device, unsigned int *speed)
{
    DEV_ENTER(nvmlDeviceGetFanSpeed, device, "fan_speed");
    if (!c.rc) {
        if (!speed)
            c.rc = NVML_ERROR_INVALID_ARGUMENT;
        else
            *speed = (unsigned int)c.gpu->fan_speed;
    }
    return leave(&c);
}

EXPORT nvmlReturn_t nvmlDeviceGetPcieThroughput(nvmlDevice_t device, unsigned int counter,
                                                unsigned int *value)
{
    DEV_ENTER(nvmlDeviceGetPcieThroughput, device,
              counter == 0 ? "pcie_throughput,pcie_tx" : counter == 1 ? "pcie_throughput,pcie_rx"
                                                                      : "pcie_throughput");
    if (!c.rc) {
        if (!value || counter > 1)
            c.rc = NVML_ERROR_INVALID_ARGUMENT;
        else
            *value = (unsigned int)(counter == 0 ? c.gpu->pcie_tx : c.gpu->pcie_rx);
    }
    if (!c.rc)
        c.delay_ms += c.cfg->pcie_throughput_ms; /* NVML answers once its window has passed */
    return leave(&c);
}

EXPORT nvmlReturn_t nvmlDeviceGetPerformanceState(nvmlDevice_t device, unsigned int *pState)
{
    DEV_ENTER(nvmlDeviceGetPerformanceState, device, "performance_state");
    if (!c.rc) {
        if (!pState)
            c.rc = NVML_ERROR_INVALID_ARGUMENT;
        else
            *pState = (unsigned int)c.gpu->performance_state;
    }
    return leave(&c);
}

EXPORT nvmlReturn_t nvmlDeviceGetCurrentClocksEventReasons(nvmlDevice_t device,
                                                           unsigned long long *reasons)
{
    DEV_ENTER(nvmlDeviceGetCurrentClocksEventReasons, device, "clocks_event_reasons");
    if (!c.rc) {
        if (!reasons)
            c.rc = NVML_ERROR_INVALID_ARGUMENT;
        else
            *reasons = c.gpu->clocks_event_reasons;
    }
    return leave(&c);
}

EXPORT nvmlReturn_t nvmlDeviceGetCurrentClocksThrottleReasons(nvmlDevice_t device,
                                                              unsigned long long *reasons)
{
    DEV_ENTER(nvmlDeviceGetCurrentClocksThrottleReasons, device, "clocks_event_reasons");
    if (!c.rc) {
        if (!reasons)
            c.rc = NVML_ERROR_INVALID_ARGUMENT;
        else
            *reasons = c.gpu->clocks_event_reasons;
    }
    return leave(&c);
}

EXPORT nvmlReturn_t nvmlDeviceGetTotalEccErrors(nvmlDevice_t device, unsigned int errorType,
                                                unsigned int counterType,
                                                unsigned long long *eccCounts)
{
    static const char *const aliases[2][2] = {
        {"ecc,ecc_corrected_volatile", "ecc,ecc_corrected_aggregate"},
        {"ecc,ecc_uncorrected_volatile", "ecc,ecc_uncorrected_aggregate"}};
    DEV_ENTER(nvmlDeviceGetTotalEccErrors, device,
              (errorType < 2 && counterType < 2) ? aliases[errorType][counterType] : "ecc");
    if (!c.rc) {
        if (!eccCounts || errorType > 1 || counterType > 1) {
            c.rc = NVML_ERROR_INVALID_ARGUMENT;
        } else {
            const unsigned long long v[2][2] = {
                {c.gpu->ecc_corrected_volatile, c.gpu->ecc_corrected_aggregate},
                {c.gpu->ecc_uncorrected_volatile, c.gpu->ecc_uncorrected_aggregate}};
            *eccCounts = v[errorType][counterType];
        }
    }
    return leave(&c);
}

/* ------------------------------------------------------------------------ */
/* Reliability: remapped rows, retired pages, PCIe replays, violation time  */
/* ------------------------------------------------------------------------ */

EXPORT nvmlReturn_t nvmlDeviceGetRemappedRows(nvmlDevice_t device, unsigned int *corrRows,
                                              unsigned int *uncRows, unsigned int *isPending,
                                              unsigned int *failureOccurred)
{
    DEV_ENTER(nvmlDeviceGetRemappedRows, device, "remapped_rows");
    if (!c.rc) {
        if (!corrRows || !uncRows || !isPending || !failureOccurred) {
            c.rc = NVML_ERROR_INVALID_ARGUMENT;
        } else {
            *corrRows = (unsigned int)c.gpu->remapped_rows_correctable;
            *uncRows = (unsigned int)c.gpu->remapped_rows_uncorrectable;
            *isPending = (unsigned int)c.gpu->remapped_rows_pending;
            *failureOccurred = (unsigned int)c.gpu->remapped_rows_failure;
        }
    }
    return leave(&c);
}

/* NVML's protocol: *pageCount too small (0 to ask) -> INSUFFICIENT_SIZE with the count needed;
 * else the addresses (made up: 4 KiB pages from 0x100000000) and their count. */
EXPORT nvmlReturn_t nvmlDeviceGetRetiredPages(nvmlDevice_t device, unsigned int cause,
                                              unsigned int *pageCount,
                                              unsigned long long *addresses)
{
    DEV_ENTER(nvmlDeviceGetRetiredPages, device,
              cause == 0   ? "retired_pages,retired_pages_single_bit"
              : cause == 1 ? "retired_pages,retired_pages_double_bit"
                           : "retired_pages");
    if (!c.rc) {
        if (!pageCount || cause > 1) {
            c.rc = NVML_ERROR_INVALID_ARGUMENT;
        } else {
            unsigned int n = (unsigned int)(cause == 0 ? c.gpu->retired_pages_single_bit
                                                       : c.gpu->retired_pages_double_bit);
            if (n > 0 && (!addresses || *pageCount < n)) {
                c.rc = NVML_ERROR_INSUFFICIENT_SIZE;
            } else {
                for (unsigned int i = 0; i < n; i++)
                    addresses[i] = 0x100000000ull + ((unsigned long long)cause << 24) + i * 4096ull;
            }
            *pageCount = n;
        }
    }
    return leave(&c);
}

EXPORT nvmlReturn_t nvmlDeviceGetRetiredPagesPendingStatus(nvmlDevice_t device,
                                                           unsigned int *isPending)
{
    DEV_ENTER(nvmlDeviceGetRetiredPagesPendingStatus, device,
              "retired_pages,retired_pages_pending");
    if (!c.rc) {
        if (!isPending)
            c.rc = NVML_ERROR_INVALID_ARGUMENT;
        else
            *isPending = c.gpu->retired_pages_pending ? 1u : 0u;
    }
    return leave(&c);
}

EXPORT nvmlReturn_t nvmlDeviceGetPcieReplayCounter(nvmlDevice_t device, unsigned int *value)
{
    DEV_ENTER(nvmlDeviceGetPcieReplayCounter, device, "pcie_replay_counter");
    if (!c.rc) {
        if (!value)
            c.rc = NVML_ERROR_INVALID_ARGUMENT;
        else
            *value = (unsigned int)c.gpu->pcie_replay_counter;
    }
    return leave(&c);
}

/* Policies 0..5 (power, thermal, sync boost, board limit, low utilization, reliability) come
 * from the config; the total-clocks policies are NOT_SUPPORTED, others a bad argument. */
EXPORT nvmlReturn_t nvmlDeviceGetViolationStatus(nvmlDevice_t device, unsigned int perfPolicyType,
                                                 nvmlViolationTime_t *violTime)
{
    static const char *const aliases[] = {
        "violation,violation_power",       "violation,violation_thermal",
        "violation,violation_sync_boost",  "violation,violation_board_limit",
        "violation,violation_low_utilization", "violation,violation_reliability"};
    DEV_ENTER(nvmlDeviceGetViolationStatus, device,
              perfPolicyType <= NVML_PERF_POLICY_RELIABILITY ? aliases[perfPolicyType]
                                                             : "violation");
    if (!c.rc) {
        if (!violTime || perfPolicyType >= NVML_PERF_POLICY_COUNT) {
            c.rc = NVML_ERROR_INVALID_ARGUMENT;
        } else if (perfPolicyType > NVML_PERF_POLICY_RELIABILITY) {
            c.rc = NVML_ERROR_NOT_SUPPORTED;
        } else {
            violTime->referenceTime = now_us();
            violTime->violationTime = c.gpu->violation[perfPolicyType];
        }
    }
    return leave(&c);
}

/* The INSUFFICIENT_SIZE protocol pynvml expects: with infos == NULL (or a too
 * small *count) set *count to the number of processes and return
 * INSUFFICIENT_SIZE (SUCCESS when there are none); else fill and succeed. */
static int in_instance(const proc_cfg *p, const struct fake_mig *only);

/* only: a MIG device, whose processes alone are listed; NULL: all of the GPU's. */
static nvmlReturn_t running_processes(const call_t *c, int type_mask, unsigned int *count,
                                      nvmlProcessInfo_t *infos, const struct fake_mig *only)
{
    unsigned int n = 0, k = 0;
    if (!count)
        return NVML_ERROR_INVALID_ARGUMENT;
    for (size_t i = 0; i < c->cfg->nprocs; i++) {
        const proc_cfg *p = &c->cfg->procs[i];
        if (p->gpu == c->idx && (p->type & type_mask) && in_instance(p, only))
            n++;
    }
    if (n == 0) {
        *count = 0;
        return NVML_SUCCESS;
    }
    if (!infos || *count < n) {
        *count = n;
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    for (size_t i = 0; i < c->cfg->nprocs; i++) {
        const proc_cfg *p = &c->cfg->procs[i];
        if (p->gpu != c->idx || !(p->type & type_mask) || !in_instance(p, only))
            continue;
        infos[k].pid = p->pid;
        infos[k].usedGpuMemory = p->used_memory;
        infos[k].gpuInstanceId = p->gpu_instance;
        infos[k].computeInstanceId = p->compute_instance;
        k++;
    }
    *count = k;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t device,
                                                            unsigned int *infoCount,
                                                            nvmlProcessInfo_t *infos)
{
    if (is_mig_handle(device))
        return mig_compute_processes(device, infoCount, infos);
    DEV_ENTER(nvmlDeviceGetComputeRunningProcesses_v3, device, "processes,compute_processes");
    if (!c.rc)
        c.rc = running_processes(&c, PROC_COMPUTE, infoCount, infos, NULL);
    return leave(&c);
}

EXPORT nvmlReturn_t nvmlDeviceGetGraphicsRunningProcesses_v3(nvmlDevice_t device,
                                                             unsigned int *infoCount,
                                                             nvmlProcessInfo_t *infos)
{
    DEV_ENTER(nvmlDeviceGetGraphicsRunningProcesses_v3, device, "processes,graphics_processes");
    if (!c.rc)
        c.rc = running_processes(&c, PROC_GRAPHICS, infoCount, infos, NULL);
    return leave(&c);
}

/* One sample per configured process of this GPU, stamped with its configured
 * timestamp (µs since the epoch) or, when that is 0, with the current time.
 * Only samples newer than lastSeenTimeStamp count; none -> NOT_FOUND. */
EXPORT nvmlReturn_t nvmlDeviceGetProcessUtilization(nvmlDevice_t device,
                                                    nvmlProcessUtilizationSample_t *utilization,
                                                    unsigned int *processSamplesCount,
                                                    unsigned long long lastSeenTimeStamp)
{
    DEV_ENTER(nvmlDeviceGetProcessUtilization, device, "process_utilization");
    if (!c.rc && mig_enabled(c.cfg, c.idx))
        c.rc = NVML_ERROR_NOT_SUPPORTED; /* as on a real GPU in MIG mode */
    if (!c.rc) {
        unsigned long long now = now_us();
        unsigned int n = 0, k = 0;
        if (!processSamplesCount) {
            c.rc = NVML_ERROR_INVALID_ARGUMENT;
            return leave(&c);
        }
        for (size_t i = 0; i < c.cfg->nprocs; i++) {
            const proc_cfg *p = &c.cfg->procs[i];
            unsigned long long ts = p->timestamp_us ? p->timestamp_us : now;
            if (p->gpu == c.idx && ts > lastSeenTimeStamp)
                n++;
        }
        if (n == 0) {
            *processSamplesCount = 0;
            c.rc = NVML_ERROR_NOT_FOUND;
        } else if (!utilization || *processSamplesCount < n) {
            *processSamplesCount = n;
            c.rc = NVML_ERROR_INSUFFICIENT_SIZE;
        } else {
            for (size_t i = 0; i < c.cfg->nprocs; i++) {
                const proc_cfg *p = &c.cfg->procs[i];
                unsigned long long ts = p->timestamp_us ? p->timestamp_us : now;
                if (p->gpu != c.idx || ts <= lastSeenTimeStamp)
                    continue;
                utilization[k].pid = p->pid;
                utilization[k].timeStamp = ts;
                utilization[k].smUtil = p->sm_util;
                utilization[k].memUtil = p->mem_util;
                utilization[k].encUtil = p->enc_util;
                utilization[k].decUtil = p->dec_util;
                k++;
            }
            *processSamplesCount = k;
        }
    }
    return leave(&c);
}

/* ------------------------------------------------------------------------ */
/* GPM (GPU performance monitoring, Hopper and newer)                       */
/* ------------------------------------------------------------------------ */

/* A sample holds, per metric id, a counter that advances with the GPU's
 * configured rate (gpu.N.gpm_metrics), and the time it was taken; the metrics
 * between two samples are the counters' differences over the time between
 * them, so they equal the rates in force. */

#define NVML_GPM_METRICS_GET_VERSION 1u
#define NVML_GPM_SUPPORT_VERSION 1u
#define NVML_GPM_METRIC_MAX 477u /* pynvml's array of metrics */
#define GPM_IDS 256u             /* ids the fake counts; higher ones are NOT_SUPPORTED */
#define MAX_GPM_SAMPLES 1024
#define GPM_SAMPLE_MAGIC 0xFA4E6A70u

struct fake_gpm_sample {
    unsigned int magic;
    int gpu;        /* -1 until nvmlGpmSampleGet fills it */
    int gi;         /* nvmlGpmMigSampleGet: its GPU instance; -1: the whole GPU */
    long long t_ns; /* CLOCK_MONOTONIC when taken */
    double counter[GPM_IDS];
};
typedef struct fake_gpm_sample *nvmlGpmSample_t;

typedef struct {
    const char *shortName;
    const char *longName;
    const char *unit;
} nvmlGpmMetricInfo_t;

typedef struct {
    unsigned int metricId;
    nvmlReturn_t nvmlReturn;
    double value;
    nvmlGpmMetricInfo_t metricInfo;
} nvmlGpmMetric_t;

typedef struct {
    unsigned int version;
    unsigned int numMetrics;
    nvmlGpmSample_t sample1;
    nvmlGpmSample_t sample2;
    nvmlGpmMetric_t metrics[]; /* pynvml gives NVML_GPM_METRIC_MAX of them */
} nvmlGpmMetricsGet_t;

typedef struct {
    unsigned int version;
    unsigned int isSupportedDevice;
} nvmlGpmSupport_t;

_Static_assert(sizeof(nvmlGpmMetric_t) == 40, "nvmlGpmMetric_t layout");
_Static_assert(offsetof(nvmlGpmMetricsGet_t, metrics) == 24, "nvmlGpmMetricsGet_t layout");
_Static_assert(sizeof(nvmlGpmSupport_t) == 8, "nvmlGpmSupport_t layout");

typedef struct {
    long long t_ns; /* 0: never sampled */
    double counter[GPM_IDS];
} gpm_acc;

static struct fake_gpm_sample *g_gpm_samples[MAX_GPM_SAMPLES];
static gpm_acc g_gpm_acc[MAX_GPUS];

static long long mono_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static int gpm_sample_slot(nvmlGpmSample_t s)
{
    for (int i = 0; s && i < MAX_GPM_SAMPLES; i++)
        if (g_gpm_samples[i] == s)
            return s->magic == GPM_SAMPLE_MAGIC ? i : -1;
    return -1;
}

/* Advance a GPU's (or GPU instance's) counters to now at the rates of "id:rate,id:rate". */
static void gpm_advance_locked(gpm_acc *acc, const char *rates)
{
    long long now = mono_ns();
    double dt = acc->t_ns ? (double)(now - acc->t_ns) / 1e9 : 0.0;
    const char *t = rates;
    while (t && *t) {
        char *end = NULL;
        unsigned long id = strtoul(t, &end, 10);
        if (end && *end == ':' && id < GPM_IDS)
            acc->counter[id] += strtod(end + 1, NULL) * dt;
        t = strchr(t, ',');
        t = t ? t + 1 : NULL;
    }
    acc->t_ns = now;
}

/* Fill a sample from the counters of GPU idx (gi -1) or of its GPU instance gi. */
static void gpm_fill(struct fake_gpm_sample *sample, int idx, int gi, const gpm_acc *acc)
{
    sample->gpu = idx;
    sample->gi = gi;
    sample->t_ns = acc->t_ns;
    memcpy(sample->counter, acc->counter, sizeof(sample->counter));
}

static const char *gpm_unit(unsigned int id)
{
    int bandwidth = id == 20 || id == 21 || (id >= 60 && id <= 159);
    return bandwidth ? "MiB/sec" : "%";
}

EXPORT nvmlReturn_t nvmlGpmQueryDeviceSupport(nvmlDevice_t device, nvmlGpmSupport_t *support)
{
    DEV_ENTER(nvmlGpmQueryDeviceSupport, device, "gpm");
    if (!c.rc) {
        if (!support)
            c.rc = NVML_ERROR_INVALID_ARGUMENT;
        else if (support->version != NVML_GPM_SUPPORT_VERSION)
            c.rc = NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
        else
            support->isSupportedDevice = c.gpu->gpm_supported ? 1u : 0u;
    }
    return leave(&c);
}

EXPORT nvmlReturn_t nvmlGpmSampleAlloc(nvmlGpmSample_t *sample)
{
    SYS_ENTER(nvmlGpmSampleAlloc);
    if (!c.rc) {
        int slot = -1;
        for (int i = 0; i < MAX_GPM_SAMPLES && slot < 0; i++)
            if (!g_gpm_samples[i])
                slot = i;
        struct fake_gpm_sample *s = slot < 0 || !sample ? NULL : calloc(1, sizeof(*s));
        if (!sample) {
            c.rc = NVML_ERROR_INVALID_ARGUMENT;
        } else if (!s) {
            c.rc = NVML_ERROR_MEMORY;
        } else {
            s->magic = GPM_SAMPLE_MAGIC;
            s->gpu = -1;
            s->gi = -1;
            g_gpm_samples[slot] = s;
            *sample = s;
        }
    }
    return leave(&c);
}

EXPORT nvmlReturn_t nvmlGpmSampleFree(nvmlGpmSample_t sample)
{
    SYS_ENTER(nvmlGpmSampleFree);
    if (!c.rc) {
        int slot = gpm_sample_slot(sample);
        if (slot < 0) {
            c.rc = NVML_ERROR_INVALID_ARGUMENT;
        } else {
            g_gpm_samples[slot] = NULL;
            sample->magic = 0;
            free(sample);
        }
    }
    return leave(&c);
}

EXPORT nvmlReturn_t nvmlGpmSampleGet(nvmlDevice_t device, nvmlGpmSample_t sample)
{
    DEV_ENTER(nvmlGpmSampleGet, device, "gpm,gpm_sample");
    if (!c.rc) {
        if (!c.gpu->gpm_supported) {
            c.rc = NVML_ERROR_NOT_SUPPORTED;
        } else if (gpm_sample_slot(sample) < 0) {
            c.rc = NVML_ERROR_INVALID_ARGUMENT;
        } else {
            gpm_advance_locked(&g_gpm_acc[c.idx], c.gpu->gpm_metrics);
            gpm_fill(sample, c.idx, -1, &g_gpm_acc[c.idx]);
        }
    }
    return leave(&c);
}

/* Both samples valid, of one GPU, the second one later. */
static nvmlReturn_t gpm_check_pair(const nvmlGpmMetricsGet_t *m)
{
    if (!m)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (m->version != NVML_GPM_METRICS_GET_VERSION)
        return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    if (m->numMetrics > NVML_GPM_METRIC_MAX || gpm_sample_slot(m->sample1) < 0 ||
        gpm_sample_slot(m->sample2) < 0)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (m->sample1->gpu < 0 || m->sample1->gpu != m->sample2->gpu ||
        m->sample1->gi != m->sample2->gi || m->sample2->t_ns <= m->sample1->t_ns)
        return NVML_ERROR_INVALID_ARGUMENT;
    return NVML_SUCCESS;
}

static void gpm_metric(nvmlGpmMetric_t *out, const nvmlGpmMetricsGet_t *m, const gpu_cfg *g)
{
    char id[16];
    unsigned int n = out->metricId;
    int len = snprintf(id, sizeof(id), "%u", n);
    out->metricInfo.shortName = NULL;
    out->metricInfo.longName = NULL;
    out->metricInfo.unit = gpm_unit(n);
    if (n == 0 || n >= GPM_IDS || name_in(g->gpm_not_supported, id, (size_t)len)) {
        out->nvmlReturn = NVML_ERROR_NOT_SUPPORTED;
        out->value = 0.0;
        return;
    }
    double seconds = (double)(m->sample2->t_ns - m->sample1->t_ns) / 1e9;
    out->nvmlReturn = NVML_SUCCESS;
    out->value = (m->sample2->counter[n] - m->sample1->counter[n]) / seconds;
}

EXPORT nvmlReturn_t nvmlGpmMetricsGet(nvmlGpmMetricsGet_t *metricsGet)
{
    SYS_ENTER(nvmlGpmMetricsGet);
    if (!c.rc)
        c.rc = gpm_check_pair(metricsGet);
    if (!c.rc) {
        const gpu_cfg *g = &c.cfg->gpus[metricsGet->sample1->gpu];
        c.rc = gpu_field_rc(g, "nvmlGpmMetricsGet", "gpm");
        for (unsigned int i = 0; !c.rc && i < metricsGet->numMetrics; i++)
            gpm_metric(&metricsGet->metrics[i], metricsGet, g);
    }
    return leave(&c);
}

/* ------------------------------------------------------------------------ */
/* Events                                                                   */
/* ------------------------------------------------------------------------ */

EXPORT nvmlReturn_t nvmlEventSetCreate(nvmlEventSet_t *set)
{
    SYS_ENTER(nvmlEventSetCreate);
    if (!c.rc) {
        int slot = -1;
        for (int i = 0; i < MAX_SETS && slot < 0; i++)
            if (!g_sets[i])
                slot = i;
        if (!set) {
            c.rc = NVML_ERROR_INVALID_ARGUMENT;
        } else if (slot < 0) {
            c.rc = NVML_ERROR_UNKNOWN;
        } else {
            struct fake_event_set *s = calloc(1, sizeof(*s));
            if (!s) {
                c.rc = NVML_ERROR_UNKNOWN;
            } else {
                s->magic = SET_MAGIC;
                s->cursor = c.cfg->nxids; /* only events appended from now on */
                g_sets[slot] = s;
                *set = s;
            }
        }
    }
    return leave(&c);
}

EXPORT nvmlReturn_t nvmlDeviceRegisterEvents(nvmlDevice_t device, unsigned long long eventTypes,
                                             nvmlEventSet_t set)
{
    DEV_ENTER(nvmlDeviceRegisterEvents, device, "events");
    if (!c.rc) {
        if (!set_valid(set))
            c.rc = NVML_ERROR_INVALID_ARGUMENT;
        else if (eventTypes & ~c.gpu->supported_event_types)
            c.rc = NVML_ERROR_NOT_SUPPORTED;
        else
            set->mask[c.idx] |= eventTypes;
    }
    return leave(&c);
}

EXPORT nvmlReturn_t nvmlDeviceGetSupportedEventTypes(nvmlDevice_t device,
                                                     unsigned long long *eventTypes)
{
    DEV_ENTER(nvmlDeviceGetSupportedEventTypes, device, "events");
    if (!c.rc) {
        if (!eventTypes)
            c.rc = NVML_ERROR_INVALID_ARGUMENT;
        else
            *eventTypes = c.gpu->supported_event_types;
    }
    return leave(&c);
}

/* nvmlEventSetWait_v2 sleeps until the config file is rewritten (inotify on its directory), as a
 * real driver blocks on an fd: waking to poll it would cost the caller's process CPU time that
 * benchmarks would charge to the agent. Without inotify it polls every WAIT_POLL_MS; with it, it
 * still looks every WAIT_WATCH_MS, in case a change reaches the file another way (a symlink). */
#define WAIT_POLL_MS 50
#define WAIT_WATCH_MS 1000

typedef struct {
    int fd;          /* inotify descriptor, -1 without one */
    char name[256];  /* the config's file name in the watched directory */
} cfg_watch;

/* Watch the config's directory (under g_lock: reads g_cfg_path). */
static void watch_config_locked(cfg_watch *w)
{
    char dir[sizeof(g_cfg_path)];
    const char *slash = strrchr(g_cfg_path, '/');
    w->fd = -1;
    if (!g_cfg_path[0] || strlen(slash ? slash + 1 : g_cfg_path) >= sizeof(w->name))
        return;
    strcpy(w->name, slash ? slash + 1 : g_cfg_path);
    if (!slash)
        strcpy(dir, ".");
    else if (slash == g_cfg_path)
        strcpy(dir, "/");
    else
        snprintf(dir, sizeof(dir), "%.*s", (int)(slash - g_cfg_path), g_cfg_path);
    w->fd = inotify_init1(IN_CLOEXEC | IN_NONBLOCK);
    if (w->fd >= 0 &&
        inotify_add_watch(w->fd, dir, IN_CLOSE_WRITE | IN_MODIFY | IN_MOVED_TO | IN_CREATE | IN_ATTRIB) < 0) {
        close(w->fd);
        w->fd = -1;
    }
}

/* Whether the pending inotify events name the config (or some were lost). */
static int config_touched(const cfg_watch *w)
{
    char buf[4096] __attribute__((aligned(__alignof__(struct inotify_event))));
    int touched = 0;
    ssize_t n;
    while ((n = read(w->fd, buf, sizeof(buf))) > 0) {
        for (char *p = buf; p < buf + n;) {
            const struct inotify_event *e = (const struct inotify_event *)p;
            if ((e->mask & IN_Q_OVERFLOW) || (e->len && !strcmp(e->name, w->name)))
                touched = 1;
            p += sizeof(*e) + e->len;
        }
    }
    return touched;
}

/* Sleep until the config may have changed, or `ms` passed. */
static void wait_config(const cfg_watch *w, long long ms)
{
    if (w->fd < 0) {
        sleep_ms((unsigned long long)(ms < WAIT_POLL_MS ? ms : WAIT_POLL_MS));
        return;
    }
    long long deadline = mono_ms() + (ms < WAIT_WATCH_MS ? ms : WAIT_WATCH_MS);
    for (long long left; (left = deadline - mono_ms()) > 0;) {
        struct pollfd pfd = {.fd = w->fd, .events = POLLIN};
        int ready = poll(&pfd, 1, (int)left);
        if (ready < 0 && errno != EINTR)
            return;
        if (ready > 0 && config_touched(w))
            return;
    }
}

/* What a wait on `set` answers before any event while a GPU registered in it has its own
 * `errors`/`not_supported` entry for nvmlEventSetWait_v2; 0 while none has. */
static nvmlReturn_t set_gpus_rc(const struct fake_event_set *set, const config_t *cfg)
{
    for (unsigned int i = 0; i < MAX_GPUS && i < cfg->device_count; i++) {
        nvmlReturn_t rc = set->mask[i] ? gpu_field_rc(&cfg->gpus[i], "nvmlEventSetWait_v2", "") : 0;
        if (rc)
            return rc;
    }
    return NVML_SUCCESS;
}

/* The first xid line a wait on `set` cannot deliver: where the first of its GPUs was lost. From
 * there on it answers GPU_IS_LOST, naming no GPU, as NVML's; SIZE_MAX while none is lost. */
static size_t set_lost_at(const struct fake_event_set *set, const config_t *cfg)
{
    size_t at = SIZE_MAX;
    for (unsigned int i = 0; i < MAX_GPUS; i++)
        if (set->mask[i] && cfg->lost_at[i] < at)
            at = cfg->lost_at[i];
    return at;
}

EXPORT nvmlReturn_t nvmlEventSetWait_v2(nvmlEventSet_t set, nvmlEventData_t *data,
                                        unsigned int timeoutms)
{
    SYS_ENTER(nvmlEventSetWait_v2);
    if (!c.rc && (!set_valid(set) || !data))
        c.rc = NVML_ERROR_INVALID_ARGUMENT;
    if (c.rc)
        return leave(&c);
    cfg_watch watch = {.fd = -1};
    /* Before the first look: a change after it wakes the wait.  A wait of 0 ms is one look, as
     * the driver's is: no watch (closing an inotify instance costs about a millisecond). */
    if (timeoutms > 0)
        watch_config_locked(&watch);
    leave(&c); /* unlock and apply delay_ms */

    long long deadline = mono_ms() + (long long)timeoutms;
    for (;;) {
        nvmlReturn_t rc = NVML_ERROR_TIMEOUT, refused;
        int delivered = 0;
        pthread_mutex_lock(&g_lock);
        if (g_refcount <= 0) {
            rc = NVML_ERROR_UNINITIALIZED;
        } else if (maybe_reload_locked(0) != 0 || !g_cfg) {
            rc = NVML_ERROR_UNINITIALIZED;
        } else if (g_cfg->fail_all) {
            rc = g_cfg->fail_all;
        } else if (!set_valid(set)) {
            rc = NVML_ERROR_INVALID_ARGUMENT;
        } else if ((refused = set_gpus_rc(set, g_cfg)) != NVML_SUCCESS) {
            rc = refused;
        } else {
            size_t lost_at = set_lost_at(set, g_cfg);
            if (set->cursor > g_cfg->nxids)
                set->cursor = g_cfg->nxids; /* list shrank: writer started over */
            while (set->cursor < g_cfg->nxids && set->cursor < lost_at) {
                const xid_cfg *x = &g_cfg->xids[set->cursor++];
                if (x->gpu < 0 || x->gpu >= MAX_GPUS || (unsigned int)x->gpu >= g_cfg->device_count)
                    continue;
                if (!(set->mask[x->gpu] & NVML_EVENT_TYPE_XID_CRITICAL_ERROR))
                    continue;
                data->device = &g_dev[x->gpu];
                data->eventType = NVML_EVENT_TYPE_XID_CRITICAL_ERROR;
                data->eventData = x->xid;
                data->gpuInstanceId = NVML_NO_INSTANCE;
                data->computeInstanceId = NVML_NO_INSTANCE;
                delivered = 1;
                rc = NVML_SUCCESS;
                break;
            }
            if (!delivered && set->cursor >= lost_at)
                rc = NVML_ERROR_GPU_IS_LOST;
        }
        pthread_mutex_unlock(&g_lock);
        long long left = deadline - mono_ms();
        if (delivered || rc != NVML_ERROR_TIMEOUT || left <= 0) {
            if (watch.fd >= 0)
                close(watch.fd);
            return rc;
        }
        wait_config(&watch, left);
    }
}

EXPORT nvmlReturn_t nvmlEventSetFree(nvmlEventSet_t set)
{
    SYS_ENTER(nvmlEventSetFree);
    if (!c.rc) {
        c.rc = NVML_ERROR_INVALID_ARGUMENT;
        for (int i = 0; set && i < MAX_SETS; i++) {
            if (g_sets[i] == set) {
                g_sets[i] = NULL;
                set->magic = 0;
                free(set);
                c.rc = NVML_SUCCESS;
                break;
            }
        }
    }
    return leave(&c);
}

/* ------------------------------------------------------------------------ */
/* MIG                                                                      */
/* ------------------------------------------------------------------------ */
/*
 * Per GPU: gpu.N.mig_mode=1 (current and pending), gpu.N.mig_pending_mode=M,
 * and one gpu.N.mig=gi,ci,profile,memory_used[,uuid] line per MIG device (a
 * compute instance `ci` of GPU instance `gi`; memory belongs to the GPU
 * instance, so its first line's memory_used counts). Profiles are an A100
 * 80GB's (mig_profiles). A MIG device whose line is gone (destroyed) answers
 * NOT_FOUND through handles taken before. Per-instance GPM goes with the GPM
 * section (nvmlGpmMigSampleGet takes the parent and a GPU instance id).
 */

#define MIG_MAX_GI 16     /* GPU instance ids 0..15 */
#define MIG_MAX_CI 8      /* compute instance ids 0..7 */
#define MIG_MAX_DEVICES 7 /* nvmlDeviceGetMaxMigDeviceCount in MIG mode */
#define MIG_MAGIC 0xFA4E0319u
#define GI_MAGIC 0xFA4E061Au
#define MIB 1048576ull

typedef struct fake_gpu_instance *nvmlGpuInstance_t;

typedef struct {
    unsigned int id;
    unsigned int isP2pSupported;
    unsigned int sliceCount;
    unsigned int instanceCount;
    unsigned int multiprocessorCount;
    unsigned int copyEngineCount;
    unsigned int decoderCount;
    unsigned int encoderCount;
    unsigned int jpegCount;
    unsigned int ofaCount;
    unsigned long long memorySizeMB;
} nvmlGpuInstanceProfileInfo_t;

typedef struct {
    unsigned int version;
    unsigned int id;
    unsigned int isP2pSupported;
    unsigned int sliceCount;
    unsigned int instanceCount;
    unsigned int multiprocessorCount;
    unsigned int copyEngineCount;
    unsigned int decoderCount;
    unsigned int encoderCount;
    unsigned int jpegCount;
    unsigned int ofaCount;
    unsigned long long memorySizeMB;
    char name[96];
} nvmlGpuInstanceProfileInfo_v2_t;

typedef struct {
    nvmlDevice_t device;
    unsigned int id;
    unsigned int profileId;
    struct {
        unsigned int start;
        unsigned int size;
    } placement;
} nvmlGpuInstanceInfo_t;

#define NVML_GPU_INSTANCE_PROFILE_INFO_V2 0x02000098u /* pynvml.nvmlGpuInstanceProfileInfo_v2 */

_Static_assert(sizeof(nvmlGpuInstanceProfileInfo_t) == 48, "profile info v1 layout");
_Static_assert(sizeof(nvmlGpuInstanceProfileInfo_v2_t) == 152, "profile info v2 layout");
_Static_assert(sizeof(nvmlGpuInstanceInfo_t) == 24, "nvmlGpuInstanceInfo_t layout");

typedef struct {
    unsigned int index, id, slices, instances, sms;
    unsigned long long memory_mb;
    const char *name;
} mig_profile;

/* By profile index (NVML_GPU_INSTANCE_PROFILE_*); other indexes are NOT_SUPPORTED. */
static const mig_profile mig_profiles[] = {
    {0, 19, 1, 7, 14, 9856, "1g.10gb"},  {1, 14, 2, 3, 28, 19968, "2g.20gb"},
    {2, 9, 3, 2, 42, 40192, "3g.40gb"},  {3, 5, 4, 1, 56, 40192, "4g.40gb"},
    {4, 0, 7, 1, 98, 80384, "7g.80gb"},  {7, 15, 1, 4, 14, 19968, "1g.20gb"},
    {9, 20, 1, 1, 14, 9856, "1g.10gb+me"},
};
#define N_MIG_PROFILES (sizeof(mig_profiles) / sizeof(mig_profiles[0]))

typedef struct {
    int gpu;
    unsigned int gi, ci;
    const mig_profile *profile;
    unsigned long long memory_used;
    char uuid[96];
} mig_dev_cfg;

typedef struct {
    int gpu;
    unsigned int gi;
    char rates[LIST_LEN]; /* "id:rate,..." as gpu.N.gpm_metrics */
} mig_gpm_cfg;

struct mig_config {
    unsigned long long mode[MAX_GPUS], pending[MAX_GPUS];
    mig_dev_cfg *devs;
    size_t ndevs, cap;
    mig_gpm_cfg *gpms; /* gpu.N.mig_gpm lines */
    size_t ngpms, gcap;
};

struct fake_mig {
    unsigned int magic;
    int gpu;
    unsigned int gi, ci;
};

struct fake_gpu_instance {
    unsigned int magic;
    int gpu;
    unsigned int gi;
};

static struct fake_mig g_mig[MAX_GPUS][MIG_MAX_GI][MIG_MAX_CI];
static struct fake_gpu_instance g_gis[MAX_GPUS][MIG_MAX_GI];

static void mig_config_free(struct mig_config *m)
{
    if (m) {
        free(m->devs);
        free(m->gpms);
    }
    free(m);
}

static const mig_profile *mig_profile_named(const char *name)
{
    for (size_t i = 0; i < N_MIG_PROFILES; i++)
        if (!strcmp(mig_profiles[i].name, name))
            return &mig_profiles[i];
    return NULL;
}

/* "gi,ci,profile,memory_used[,uuid]" */
static int mig_parse_device(const char *v, unsigned int gpu, mig_dev_cfg *d)
{
    char buf[256], *save = NULL, *tok;
    int col = 0;
    memset(d, 0, sizeof(*d));
    d->gpu = (int)gpu;
    copy_str(buf, sizeof(buf), v);
    for (tok = strtok_r(buf, ",", &save); tok; tok = strtok_r(NULL, ",", &save), col++) {
        while (*tok == ' ')
            tok++;
        switch (col) {
        case 0: d->gi = (unsigned int)parse_u64(tok); break;
        case 1: d->ci = (unsigned int)parse_u64(tok); break;
        case 2: d->profile = mig_profile_named(tok); break;
        case 3: d->memory_used = parse_u64(tok); break;
        case 4: copy_str(d->uuid, sizeof(d->uuid), tok); break;
        default: break;
        }
    }
    if (col < 3 || !d->profile || d->gi >= MIG_MAX_GI || d->ci >= MIG_MAX_CI)
        return 0;
    if (!d->uuid[0])
        snprintf(d->uuid, sizeof(d->uuid), "MIG-fa4e0000-%04x-4000-8000-%06x%06x", gpu, d->gi,
                 d->ci);
    return 1;
}

/* "gi,id:rate,id:rate,...": the GPM rates of GPU instance gi. */
static void mig_add_gpm(struct mig_config *m, unsigned int gpu, const char *v)
{
    mig_gpm_cfg g;
    const char *comma = strchr(v, ',');
    memset(&g, 0, sizeof(g));
    g.gpu = (int)gpu;
    g.gi = (unsigned int)parse_u64(v);
    copy_str(g.rates, sizeof(g.rates), comma ? comma + 1 : "");
    if (g.gi < MIG_MAX_GI)
        push((void **)&m->gpms, &m->ngpms, &m->gcap, sizeof(g), &g);
}

/* A gpu.N.<field> key of this section: applied, returns 1; else 0. */
static int mig_apply_key(config_t *c, unsigned int gpu, const char *field, const char *val)
{
    int is_mode = !strcmp(field, "mig_mode"), is_pending = !strcmp(field, "mig_pending_mode");
    int is_gpm = !strcmp(field, "mig_gpm");
    if (!is_mode && !is_pending && !is_gpm && strcmp(field, "mig"))
        return 0;
    if (!c->mig && !(c->mig = calloc(1, sizeof(*c->mig))))
        return 1;
    if (is_gpm) {
        mig_add_gpm(c->mig, gpu, val);
    } else if (is_mode) {
        c->mig->mode[gpu] = c->mig->pending[gpu] = parse_bool(val);
    } else if (is_pending) {
        c->mig->pending[gpu] = parse_bool(val);
    } else {
        mig_dev_cfg d;
        if (mig_parse_device(val, gpu, &d))
            push((void **)&c->mig->devs, &c->mig->ndevs, &c->mig->cap, sizeof(d), &d);
    }
    return 1;
}

static int mig_enabled(const config_t *cfg, int gpu)
{
    return cfg && cfg->mig && gpu >= 0 && gpu < MAX_GPUS && cfg->mig->mode[gpu];
}

static const mig_dev_cfg *mig_find(const config_t *cfg, int gpu, unsigned int gi, int ci)
{
    if (!mig_enabled(cfg, gpu))
        return NULL;
    for (size_t i = 0; i < cfg->mig->ndevs; i++) {
        const mig_dev_cfg *d = &cfg->mig->devs[i];
        if (d->gpu == gpu && d->gi == gi && (ci < 0 || d->ci == (unsigned int)ci))
            return d;
    }
    return NULL;
}

static int is_mig_handle(nvmlDevice_t d)
{
    uintptr_t p = (uintptr_t)d, base = (uintptr_t)&g_mig[0][0][0];
    if (!d || p < base || p >= base + sizeof(g_mig) || (p - base) % sizeof(g_mig[0][0][0]))
        return 0;
    return ((const struct fake_mig *)(const void *)d)->magic == MIG_MAGIC;
}

static int in_instance(const proc_cfg *p, const struct fake_mig *only)
{
    return !only || (p->gpu_instance == only->gi && p->compute_instance == only->ci);
}

/* enter() for a call on a MIG device handle: the parent's checks, then the instance must still
 * exist (NOT_FOUND once destroyed); *dev is its config line. */
static call_t mig_enter(enum fn_id id, nvmlDevice_t d, const mig_dev_cfg **dev)
{
    const struct fake_mig *m = is_mig_handle(d) ? (const struct fake_mig *)(const void *)d : NULL;
    call_t c = enter(id, 1, m ? &g_dev[m->gpu] : NULL, "mig");
    *dev = NULL;
    if (!c.rc) {
        *dev = mig_find(c.cfg, m->gpu, m->gi, (int)m->ci);
        if (!*dev)
            c.rc = NVML_ERROR_NOT_FOUND;
    }
    return c;
}

static void mig_handles_init(void)
{
    for (int g = 0; g < MAX_GPUS; g++) {
        for (unsigned int gi = 0; gi < MIG_MAX_GI; gi++) {
            g_gis[g][gi] = (struct fake_gpu_instance){GI_MAGIC, g, gi};
            for (unsigned int ci = 0; ci < MIG_MAX_CI; ci++)
                g_mig[g][gi][ci] = (struct fake_mig){MIG_MAGIC, g, gi, ci};
        }
    }
}

static pthread_once_t g_mig_once = PTHREAD_ONCE_INIT;

static nvmlDevice_t mig_handle(const mig_dev_cfg *d)
{
    pthread_once(&g_mig_once, mig_handles_init);
    return (nvmlDevice_t)(void *)&g_mig[d->gpu][d->gi][d->ci];
}

static nvmlReturn_t mig_uuid(nvmlDevice_t d, char *uuid, unsigned int length)
{
    const mig_dev_cfg *dev;
    call_t c = mig_enter(F_nvmlDeviceGetUUID, d, &dev);
    if (!c.rc)
        c.rc = copy_out_str(uuid, length, dev->uuid);
    return leave(&c);
}

/* A MIG device's memory is its GPU instance's. */
static nvmlReturn_t mig_memory(nvmlDevice_t d, nvmlMemory_t *m)
{
    const mig_dev_cfg *dev;
    call_t c = mig_enter(F_nvmlDeviceGetMemoryInfo, d, &dev);
    if (!c.rc && !m)
        c.rc = NVML_ERROR_INVALID_ARGUMENT;
    if (!c.rc) {
        const mig_dev_cfg *first = mig_find(c.cfg, dev->gpu, dev->gi, -1);
        m->total = first->profile->memory_mb * MIB;
        m->used = first->memory_used;
        m->free = m->used < m->total ? m->total - m->used : 0;
    }
    return leave(&c);
}

static nvmlReturn_t mig_compute_processes(nvmlDevice_t d, unsigned int *count,
                                          nvmlProcessInfo_t *infos)
{
    const mig_dev_cfg *dev;
    call_t c = mig_enter(F_nvmlDeviceGetComputeRunningProcesses_v3, d, &dev);
    if (!c.rc)
        c.rc = running_processes(&c, PROC_COMPUTE, count, infos,
                                 (const struct fake_mig *)(const void *)d);
    return leave(&c);
}

EXPORT nvmlReturn_t nvmlDeviceGetMigMode(nvmlDevice_t device, unsigned int *current,
                                         unsigned int *pending)
{
    DEV_ENTER(nvmlDeviceGetMigMode, device, "mig,mig_mode");
    if (!c.rc && (!current || !pending)) {
        c.rc = NVML_ERROR_INVALID_ARGUMENT;
    } else if (!c.rc) {
        *current = c.cfg->mig ? (unsigned int)c.cfg->mig->mode[c.idx] : 0;
        *pending = c.cfg->mig ? (unsigned int)c.cfg->mig->pending[c.idx] : 0;
    }
    return leave(&c);
}

EXPORT nvmlReturn_t nvmlDeviceGetMaxMigDeviceCount(nvmlDevice_t device, unsigned int *count)
{
    DEV_ENTER(nvmlDeviceGetMaxMigDeviceCount, device, "mig");
    if (!c.rc && !count)
        c.rc = NVML_ERROR_INVALID_ARGUMENT;
    else if (!c.rc)
        *count = mig_enabled(c.cfg, c.idx) ? MIG_MAX_DEVICES : 0;
    return leave(&c);
}

/* The index-th configured MIG device of the GPU; NOT_FOUND past the last one. */
EXPORT nvmlReturn_t nvmlDeviceGetMigDeviceHandleByIndex(nvmlDevice_t device, unsigned int index,
                                                        nvmlDevice_t *migDevice)
{
    DEV_ENTER(nvmlDeviceGetMigDeviceHandleByIndex, device, "mig");
    if (!c.rc && (!migDevice || index >= MIG_MAX_DEVICES))
        c.rc = NVML_ERROR_INVALID_ARGUMENT;
    if (!c.rc) {
        unsigned int k = 0;
        c.rc = NVML_ERROR_NOT_FOUND;
        for (size_t i = 0; mig_enabled(c.cfg, c.idx) && i < c.cfg->mig->ndevs; i++) {
            const mig_dev_cfg *d = &c.cfg->mig->devs[i];
            if (d->gpu == c.idx && k++ == index) {
                *migDevice = mig_handle(d);
                c.rc = NVML_SUCCESS;
                break;
            }
        }
    }
    return leave(&c);
}

EXPORT nvmlReturn_t nvmlDeviceIsMigDeviceHandle(nvmlDevice_t device, unsigned int *isMigDevice)
{
    SYS_ENTER(nvmlDeviceIsMigDeviceHandle);
    if (!c.rc && !isMigDevice)
        c.rc = NVML_ERROR_INVALID_ARGUMENT;
    else if (!c.rc)
        *isMigDevice = (unsigned int)is_mig_handle(device);
    return leave(&c);
}

EXPORT nvmlReturn_t nvmlDeviceGetGpuInstanceId(nvmlDevice_t device, unsigned int *id)
{
    const mig_dev_cfg *dev;
    call_t c = mig_enter(F_nvmlDeviceGetGpuInstanceId, device, &dev);
    if (!c.rc && !id)
        c.rc = NVML_ERROR_INVALID_ARGUMENT;
    else if (!c.rc)
        *id = dev->gi;
    return leave(&c);
}

EXPORT nvmlReturn_t nvmlDeviceGetComputeInstanceId(nvmlDevice_t device, unsigned int *id)
{
    const mig_dev_cfg *dev;
    call_t c = mig_enter(F_nvmlDeviceGetComputeInstanceId, device, &dev);
    if (!c.rc && !id)
        c.rc = NVML_ERROR_INVALID_ARGUMENT;
    else if (!c.rc)
        *id = dev->ci;
    return leave(&c);
}

EXPORT nvmlReturn_t nvmlDeviceGetDeviceHandleFromMigDeviceHandle(nvmlDevice_t migDevice,
                                                                 nvmlDevice_t *device)
{
    const mig_dev_cfg *dev;
    call_t c = mig_enter(F_nvmlDeviceGetDeviceHandleFromMigDeviceHandle, migDevice, &dev);
    if (!c.rc && !device)
        c.rc = NVML_ERROR_INVALID_ARGUMENT;
    else if (!c.rc)
        *device = &g_dev[dev->gpu];
    return leave(&c);
}

/* The profile at `index` of a GPU in MIG mode, else NULL with *rc set. */
static const mig_profile *mig_profile_at(const call_t *c, unsigned int index, nvmlReturn_t *rc)
{
    *rc = NVML_ERROR_NOT_SUPPORTED;
    if (!mig_enabled(c->cfg, c->idx))
        return NULL;
    for (size_t i = 0; i < N_MIG_PROFILES; i++) {
        if (mig_profiles[i].index == index) {
            *rc = NVML_SUCCESS;
            return &mig_profiles[i];
        }
    }
    *rc = index < 0x12 ? NVML_ERROR_NOT_SUPPORTED : NVML_ERROR_INVALID_ARGUMENT;
    return NULL;
}

static void mig_profile_fill(const mig_profile *p, nvmlGpuInstanceProfileInfo_t *info)
{
    memset(info, 0, sizeof(*info));
    info->id = p->id;
    info->sliceCount = p->slices;
    info->instanceCount = p->instances;
    info->multiprocessorCount = p->sms;
    info->copyEngineCount = p->slices;
    info->memorySizeMB = p->memory_mb;
}

EXPORT nvmlReturn_t nvmlDeviceGetGpuInstanceProfileInfo(nvmlDevice_t device, unsigned int profile,
                                                        nvmlGpuInstanceProfileInfo_t *info)
{
    DEV_ENTER(nvmlDeviceGetGpuInstanceProfileInfo, device, "mig,mig_profiles");
    if (!c.rc && !info)
        c.rc = NVML_ERROR_INVALID_ARGUMENT;
    if (!c.rc) {
        const mig_profile *p = mig_profile_at(&c, profile, &c.rc);
        if (p)
            mig_profile_fill(p, info);
    }
    return leave(&c);
}

EXPORT nvmlReturn_t nvmlDeviceGetGpuInstanceProfileInfoV(nvmlDevice_t device, unsigned int profile,
                                                         nvmlGpuInstanceProfileInfo_v2_t *info)
{
    DEV_ENTER(nvmlDeviceGetGpuInstanceProfileInfoV, device, "mig,mig_profiles");
    if (!c.rc && !info)
        c.rc = NVML_ERROR_INVALID_ARGUMENT;
    else if (!c.rc && info->version != NVML_GPU_INSTANCE_PROFILE_INFO_V2)
        c.rc = NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    if (!c.rc) {
        const mig_profile *p = mig_profile_at(&c, profile, &c.rc);
        if (p) {
            nvmlGpuInstanceProfileInfo_t v1;
            mig_profile_fill(p, &v1);
            memcpy(&info->id, &v1, offsetof(nvmlGpuInstanceProfileInfo_t, memorySizeMB));
            info->memorySizeMB = v1.memorySizeMB;
            snprintf(info->name, sizeof(info->name), "MIG %s", p->name);
        }
    }
    return leave(&c);
}

/* The GPU instances of one profile id, in id order (the array holds the profile's instanceCount). */
EXPORT nvmlReturn_t nvmlDeviceGetGpuInstances(nvmlDevice_t device, unsigned int profileId,
                                              nvmlGpuInstance_t *instances, unsigned int *count)
{
    DEV_ENTER(nvmlDeviceGetGpuInstances, device, "mig");
    if (!c.rc && (!instances || !count))
        c.rc = NVML_ERROR_INVALID_ARGUMENT;
    else if (!c.rc && !mig_enabled(c.cfg, c.idx))
        c.rc = NVML_ERROR_NOT_SUPPORTED;
    if (!c.rc) {
        unsigned int n = 0;
        pthread_once(&g_mig_once, mig_handles_init);
        for (unsigned int gi = 0; gi < MIG_MAX_GI; gi++) {
            const mig_dev_cfg *d = mig_find(c.cfg, c.idx, gi, -1);
            if (d && d->profile->id == profileId && n < d->profile->instances)
                instances[n++] = &g_gis[c.idx][gi];
        }
        *count = n;
    }
    return leave(&c);
}

EXPORT nvmlReturn_t nvmlDeviceGetGpuInstanceById(nvmlDevice_t device, unsigned int id,
                                                 nvmlGpuInstance_t *instance)
{
    DEV_ENTER(nvmlDeviceGetGpuInstanceById, device, "mig");
    if (!c.rc && !instance)
        c.rc = NVML_ERROR_INVALID_ARGUMENT;
    else if (!c.rc && !mig_enabled(c.cfg, c.idx))
        c.rc = NVML_ERROR_NOT_SUPPORTED;
    else if (!c.rc && (id >= MIG_MAX_GI || !mig_find(c.cfg, c.idx, id, -1)))
        c.rc = NVML_ERROR_NOT_FOUND;
    if (!c.rc) {
        pthread_once(&g_mig_once, mig_handles_init);
        *instance = &g_gis[c.idx][id];
    }
    return leave(&c);
}

static int gpu_instance_valid(nvmlGpuInstance_t g)
{
    uintptr_t p = (uintptr_t)g, base = (uintptr_t)&g_gis[0][0];
    return g && p >= base && p < base + sizeof(g_gis) && !((p - base) % sizeof(g_gis[0][0])) &&
           g->magic == GI_MAGIC;
}

EXPORT nvmlReturn_t nvmlGpuInstanceGetInfo(nvmlGpuInstance_t gpuInstance,
                                           nvmlGpuInstanceInfo_t *info)
{
    int valid = gpu_instance_valid(gpuInstance);
    call_t c = enter(F_nvmlGpuInstanceGetInfo, 1, valid ? &g_dev[gpuInstance->gpu] : NULL, "mig");
    const mig_dev_cfg *d = c.rc ? NULL : mig_find(c.cfg, c.idx, gpuInstance->gi, -1);
    if (!c.rc && !info)
        c.rc = NVML_ERROR_INVALID_ARGUMENT;
    else if (!c.rc && !d)
        c.rc = NVML_ERROR_NOT_FOUND; /* destroyed */
    if (!c.rc) {
        info->device = &g_dev[c.idx];
        info->id = d->gi;
        info->profileId = d->profile->id;
        info->placement.start = 0;
        info->placement.size = d->profile->slices;
    }
    return leave(&c);
}

/* The configured GPM rates of a GPU instance; "" (every rate 0) without a mig_gpm line. */
static const char *mig_gpm_rates(const config_t *cfg, int gpu, unsigned int gi)
{
    for (size_t i = 0; cfg->mig && i < cfg->mig->ngpms; i++)
        if (cfg->mig->gpms[i].gpu == gpu && cfg->mig->gpms[i].gi == gi)
            return cfg->mig->gpms[i].rates;
    return "";
}

static gpm_acc g_gpm_mig_acc[MAX_GPUS][MIG_MAX_GI];

/* A GPM sample of one GPU instance, through the parent's handle (as NVML). */
EXPORT nvmlReturn_t nvmlGpmMigSampleGet(nvmlDevice_t device, unsigned int gpuInstanceId,
                                        nvmlGpmSample_t sample)
{
    DEV_ENTER(nvmlGpmMigSampleGet, device, "gpm,gpm_sample,mig");
    if (!c.rc) {
        if (!c.gpu->gpm_supported || !mig_enabled(c.cfg, c.idx))
            c.rc = NVML_ERROR_NOT_SUPPORTED;
        else if (gpm_sample_slot(sample) < 0)
            c.rc = NVML_ERROR_INVALID_ARGUMENT;
        else if (gpuInstanceId >= MIG_MAX_GI || !mig_find(c.cfg, c.idx, gpuInstanceId, -1))
            c.rc = NVML_ERROR_NOT_FOUND; /* no such GPU instance, or destroyed */
    }
    if (!c.rc) {
        gpm_acc *acc = &g_gpm_mig_acc[c.idx][gpuInstanceId];
        gpm_advance_locked(acc, mig_gpm_rates(c.cfg, c.idx, gpuInstanceId));
        gpm_fill(sample, c.idx, (int)gpuInstanceId, acc);
    }
    return leave(&c);
}
