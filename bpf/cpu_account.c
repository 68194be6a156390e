// On-CPU time per thread group (tgid), accounted at each sched_switch.
//
// Compiled by bcc at start-up. It reads no kernel struct through the (possibly
// mismatched) headers: only BPF helpers, the tracepoint's own record, and, on
// kernels with BTF, task_struct.tgid at the offset the loader found in the
// running kernel's BTF. User space drains cpu_ns and task_info every interval.
//
// Build-time macros (set by the loader):
//   MAP_ENTRIES        size of the per-tgid maps (thread groups that run within one interval)
//   TASK_TGID_OFFSET   byte offset of tgid in struct task_struct (from /sys/kernel/btf/vmlinux):
//                      attach as raw tracepoints, the cheap path; without it, classic tracepoints
//   SOFTIRQ            count softirqs per vector
//   HW_COUNTERS        add per-tgid cycles and instructions (perf hardware counters exist)
//   POSSIBLE_CPUS      number of possible CPUs (with HW_COUNTERS)

#define NR_VECTORS 10  // NR_SOFTIRQS
#define COMM_LEN 16    // TASK_COMM_LEN, the size of the tracepoint's comm fields

// Per CPU: since when the current task runs, and who it is (tgid on the raw
// path, thread id on the classic one); read by user space for in-flight time.
struct slice_t {
    u64 start_ns;
    u32 tid;
    u32 tgid;
};

struct task_info_t {
    u64 cgroup_id;
    char comm[COMM_LEN];
};

BPF_PERCPU_ARRAY(slice, struct slice_t, 1);
// Per CPU, so the hot path needs neither locks nor atomics.
BPF_PERCPU_HASH(cpu_ns, u32, u64, MAP_ENTRIES);
BPF_HASH(task_info, u32, struct task_info_t, MAP_ENTRIES);

#ifdef HW_COUNTERS
struct hw_t {
    u64 cycles;
    u64 instructions;
};

BPF_PERF_ARRAY(cycles_event, POSSIBLE_CPUS);
BPF_PERF_ARRAY(instructions_event, POSSIBLE_CPUS);
BPF_PERCPU_ARRAY(hw_last, struct hw_t, 1);
BPF_PERCPU_HASH(hw_count, u32, struct hw_t, MAP_ENTRIES);

static inline void account_hw(u32 tgid)
{
    u32 zero = 0;
    struct hw_t *last = hw_last.lookup(&zero);
    struct bpf_perf_event_value cycles = {}, instructions = {};
    if (!last)
        return;
    if (cycles_event.perf_counter_value(CUR_CPU_IDENTIFIER, &cycles, sizeof(cycles)) ||
        instructions_event.perf_counter_value(CUR_CPU_IDENTIFIER, &instructions, sizeof(instructions)))
        return;
    if (tgid && last->cycles) {
        struct hw_t zeros = {};
        struct hw_t *count = hw_count.lookup_or_try_init(&tgid, &zeros);
        if (count) {
            count->cycles += cycles.counter - last->cycles;
            count->instructions += instructions.counter - last->instructions;
        }
    }
    last->cycles = cycles.counter;
    last->instructions = instructions.counter;
}
#endif

// Comm and cgroup of the current task's thread group.
static inline void record_info(u32 tgid)
{
    struct task_info_t info = {.cgroup_id = bpf_get_current_cgroup_id()};
    bpf_get_current_comm(&info.comm, sizeof(info.comm));
    task_info.update(&tgid, &info);
}

// Called at sched_switch, while current is still the task leaving the CPU.
static inline void switch_to(u32 next_tid, u32 next_tgid)
{
    u32 zero = 0;
    struct slice_t *s = slice.lookup(&zero);
    if (!s)
        return;
    u64 now = bpf_ktime_get_ns();
    u32 tgid = bpf_get_current_pid_tgid() >> 32;
    if (tgid && s->start_ns) {
        u64 initial = 0;
        u64 *ns = cpu_ns.lookup_or_try_init(&tgid, &initial);
        if (ns) {
            if (*ns == 0)
                record_info(tgid);  // first slice of this tgid on this CPU since the last drain
            *ns += now - s->start_ns;
        }
    }
#ifdef HW_COUNTERS
    account_hw(tgid);
#endif
    s->start_ns = now;
    s->tid = next_tid;
    s->tgid = next_tgid;
}

#ifdef TASK_TGID_OFFSET
// TP_PROTO(bool preempt, struct task_struct *prev, struct task_struct *next, ...)
RAW_TRACEPOINT_PROBE(sched_switch)
{
    u32 next_tgid = 0;
    bpf_probe_read_kernel(&next_tgid, sizeof(next_tgid), (void *)ctx->args[2] + TASK_TGID_OFFSET);
    // A switch between threads of one group changes nothing to account: the slice goes on.
    if (next_tgid && next_tgid == bpf_get_current_pid_tgid() >> 32)
        return 0;
    switch_to(0, next_tgid);
    return 0;
}

// Current is the exiting thread: keep its final comm (after exec) and cgroup.
RAW_TRACEPOINT_PROBE(sched_process_exit)
{
    record_info(bpf_get_current_pid_tgid() >> 32);
    return 0;
}
#else
TRACEPOINT_PROBE(sched, sched_switch)
{
    switch_to(args->next_pid, 0);
    return 0;
}

TRACEPOINT_PROBE(sched, sched_process_exit)
{
    record_info(bpf_get_current_pid_tgid() >> 32);
    return 0;
}
#endif

#ifdef SOFTIRQ
BPF_PERCPU_ARRAY(softirqs, u64, NR_VECTORS);

static inline void count_softirq(u32 vec)
{
    u64 *count = softirqs.lookup(&vec);
    if (count)
        (*count)++;
}

#ifdef TASK_TGID_OFFSET
// TP_PROTO(unsigned int vec_nr)
RAW_TRACEPOINT_PROBE(softirq_entry)
{
    count_softirq(ctx->args[0]);
    return 0;
}
#else
TRACEPOINT_PROBE(irq, softirq_entry)
{
    count_softirq(args->vec);
    return 0;
}
#endif
#endif
