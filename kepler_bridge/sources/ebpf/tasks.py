"""The task iterator's records (bpf/cpu_account.c's struct task_rec, one per thread) by thread
group, kept from one pass to the next: a pass sums again only the groups whose records changed,
so thousands of sleeping processes cost a set difference, not a Python loop each."""

from __future__ import annotations

import struct

TASK = struct.Struct("<IIQIIQQ16s")  # struct task_rec
_RECORD = struct.Struct(f"{TASK.size}s")
_TGID = struct.Struct("<I")

Leader = tuple[int, int, bytes]  # a group leader's start ns, cgroup id and comm


def group_records(data: bytes) -> tuple[dict[int, int], dict[int, Leader], set[int]]:
    """Sum the iterator's per-thread records by thread group: runtime ns by tgid, the leaders'
    (start ns, cgroup id, comm), and the groups whose sum cannot be trusted this pass."""
    totals: dict[int, int] = {}
    seqs: dict[int, int] = {}
    leaders: dict[int, Leader] = {}
    torn: set[int] = set()
    for tgid, _, runtime, seq, leader, start, cgroup_id, comm in TASK.iter_unpack(data):
        totals[tgid] = totals.get(tgid, 0) + runtime
        # A thread released during the pass moved its runtime into the group's sum:
        # it may be counted twice.
        if seqs.setdefault(tgid, seq) != seq or seq & 1:
            torn.add(tgid)
        if leader:
            leaders[tgid] = (start, cgroup_id, comm)
    return totals, leaders, torn


class TaskGroups:
    """The thread groups of the last pass: each group's records, and the groups to sum again at
    the next pass whatever their records (torn in this one, or dropped by the process cap)."""

    def __init__(self) -> None:
        self.records: set[bytes] = set()
        self.groups: dict[int, tuple[bytes, ...]] = {}
        self.retry: set[int] = set()

    def update(self, data: bytes) -> tuple[dict[int, tuple[Leader, int]], set[int]]:
        """Take a pass's output: the groups that changed and can be trusted, tgid -> (leader,
        runtime ns), and the tgids whose leader is gone."""
        records = {record for (record,) in _RECORD.iter_unpack(data)}
        removed = _by_tgid(self.records - records)
        added = _by_tgid(records - self.records)
        self.records = records
        retry, self.retry = self.retry, set()
        changed: dict[int, tuple[Leader, int]] = {}
        gone: set[int] = set()
        for tgid in removed.keys() | added.keys() | retry:
            group = self._regroup(tgid, removed.get(tgid, []), added.get(tgid, []))
            totals, leaders, torn = group_records(b"".join(group))
            if tgid not in leaders:
                gone.add(tgid)
            elif tgid in torn:
                self.retry.add(tgid)
            else:
                changed[tgid] = (leaders[tgid], totals[tgid])
        return changed, gone

    def _regroup(self, tgid: int, removed: list[bytes], added: list[bytes]) -> tuple[bytes, ...]:
        """The group's records after this pass's changes (none when it is gone)."""
        old = self.groups.pop(tgid, ())
        group = tuple(record for record in old if record not in removed) + tuple(added)
        if group:
            self.groups[tgid] = group
        return group


def _by_tgid(records: set[bytes]) -> dict[int, list[bytes]]:
    found: dict[int, list[bytes]] = {}
    for record in records:
        found.setdefault(_TGID.unpack_from(record)[0], []).append(record)
    return found
