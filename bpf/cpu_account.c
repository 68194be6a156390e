// CPU time per thread group (tgid) from the kernel's own accounting: nothing runs per context switch.
//
// Compiled by bcc at start-up. Two programs:
//   bpf_iter__task        a task iterator: each read of an iterator created from its link writes one
//                         struct task_rec per thread (user space sums them per tgid, once per sample);
//   sched_process_free    when a thread group's leader is freed, its group's final runtime goes into
//                         `exits` (drained in the samples after `exit_counts.added` moved), so groups that end
//                         between samples are counted.
// Kernel structs are read only at byte offsets the loader found in the running kernel's BTF
// (/sys/kernel/btf/vmlinux), never through the (possibly mismatched) headers. The iterator gets its
// task as a BTF-typed pointer, so it loads the fields directly (the verifier checks each offset
// against that BTF and makes the loads fault-safe): a helper call per field cost more than the
// rest of the pass. The tracepoint's argument is a plain number, read with bpf_probe_read_kernel:
//   TASK_PID TASK_TGID TASK_RUNTIME (se.sum_exec_runtime) TASK_START (start_boottime) TASK_COMM
//   TASK_SIGNAL TASK_CGROUPS; SIGNAL_LIVE SIGNAL_RUNTIME (sum_sched_runtime: released threads)
//   SIGNAL_SEQ (stats_lock sequence, bumped when a thread's runtime moves into sum_sched_runtime);
//   CSS_SET_CGROUP (dfl_cgrp) CGROUP_KN KERNFS_ID: the cgroup v2 id, as bpf_get_current_cgroup_id().
// MAP_ENTRIES sizes `exits` (thread groups that end within one interval).

#define COMM_LEN 16  // TASK_COMM_LEN

// The kernel's struct bpf_iter_meta and struct bpf_iter__task (only these offsets are used).
struct iter_meta {
    struct seq_file *seq;
    u64 session_id;
    u64 seq_num;
};

struct iter_task {
    struct iter_meta *meta;
    void *task;
};

struct task_rec {
    u32 tgid;
    u32 tid;
    u64 runtime_ns;  // this thread's; the leader's adds its group's released threads
    u32 seq;         // stats_lock sequence around the reads; odd when a thread was released meanwhile
    u32 leader;      // 1 on the group leader's record, which alone carries the fields below
    u64 start_ns;
    u64 cgroup_id;
    char comm[COMM_LEN];
};

struct exit_key {
    u32 tgid;
    u32 pad;
    u64 start_ns;
};

struct exit_rec {
    u64 runtime_ns;
    u64 cgroup_id;
    char comm[COMM_LEN];
};

// Thread groups put into `exits`, and those it had no room for: one entry, read in one lookup.
// User space drains `exits` only when `added` moved, since a drain walks all of the map's buckets,
// empty or not.
struct exit_counts {
    u64 added;
    u64 lost;
};

BPF_HASH(exits, struct exit_key, struct exit_rec, MAP_ENTRIES);
BPF_ARRAY(exit_counts, struct exit_counts, 1);

static inline u64 read_u64(void *base, u32 offset)
{
    u64 value = 0;
    bpf_probe_read_kernel(&value, sizeof(value), base + offset);
    return value;
}

static inline u32 read_u32(void *base, u32 offset)
{
    u32 value = 0;
    bpf_probe_read_kernel(&value, sizeof(value), base + offset);
    return value;
}

static inline u64 cgroup_id(void *task)
{
    void *cset = (void *)read_u64(task, TASK_CGROUPS);
    void *cgroup = cset ? (void *)read_u64(cset, CSS_SET_CGROUP) : 0;
    void *kn = cgroup ? (void *)read_u64(cgroup, CGROUP_KN) : 0;
    return kn ? read_u64(kn, KERNFS_ID) : 0;
}

// A field of a BTF-typed kernel pointer, loaded directly; volatile keeps the loads in the order
// written (the stats_lock sequence reads bracket the runtime reads).
#define LOAD(type, base, offset) (*(type volatile *)((char *)(base) + (offset)))

int bpf_iter__task(struct iter_task *ctx)
{
    struct seq_file *seq = ctx->meta->seq;
    void *task = ctx->task;
    struct task_rec rec = {};
    if (!task)
        return 0;
    void *signal = LOAD(void *, task, TASK_SIGNAL);
    if (!signal)
        return 0;
    rec.tgid = LOAD(u32, task, TASK_TGID);
    rec.tid = LOAD(u32, task, TASK_PID);
    u32 seq_before = LOAD(u32, signal, SIGNAL_SEQ);
    rec.runtime_ns = LOAD(u64, task, TASK_RUNTIME);
    if (rec.tid == rec.tgid) {
        rec.leader = 1;
        rec.runtime_ns += LOAD(u64, signal, SIGNAL_RUNTIME);
        rec.start_ns = LOAD(u64, task, TASK_START);
        void *cset = LOAD(void *, task, TASK_CGROUPS);
        void *cgroup = cset ? LOAD(void *, cset, CSS_SET_CGROUP) : 0;
        void *kn = cgroup ? LOAD(void *, cgroup, CGROUP_KN) : 0;
        rec.cgroup_id = kn ? LOAD(u64, kn, KERNFS_ID) : 0;
        // comm is a char array: the verifier allows loads of any size within it.
        *(u64 *)&rec.comm[0] = LOAD(u64, task, TASK_COMM);
        *(u64 *)&rec.comm[8] = LOAD(u64, task, TASK_COMM + 8);
    }
    u32 seq_after = LOAD(u32, signal, SIGNAL_SEQ);
    rec.seq = seq_before == seq_after ? seq_after : 1;
    bpf_seq_write(seq, &rec, sizeof(rec));
    return 0;
}

// TP_PROTO(struct task_struct *p): after the task's last context switch and its release, so its
// runtime is final. Only the leader of a dead group is recorded: by then every thread's runtime,
// the leader's included, is in signal->sum_sched_runtime.
RAW_TRACEPOINT_PROBE(sched_process_free)
{
    void *task = (void *)ctx->args[0];
    struct exit_key key = {};
    struct exit_rec rec = {};
    key.tgid = read_u32(task, TASK_TGID);
    if (!key.tgid || read_u32(task, TASK_PID) != key.tgid)
        return 0;
    void *signal = (void *)read_u64(task, TASK_SIGNAL);
    if (!signal || read_u32(signal, SIGNAL_LIVE))
        return 0;  // a leader replaced by exec in another thread: its group lives on
    key.start_ns = read_u64(task, TASK_START);
    rec.runtime_ns = read_u64(signal, SIGNAL_RUNTIME);
    rec.cgroup_id = cgroup_id(task);
    bpf_probe_read_kernel(&rec.comm, sizeof(rec.comm), task + TASK_COMM);
    u32 zero = 0;
    int full = exits.insert(&key, &rec);
    struct exit_counts *counts = exit_counts.lookup(&zero);
    if (counts)
        __sync_fetch_and_add(full ? &counts->lost : &counts->added, 1);
    return 0;
}
