"""The task iterator's records (bpf/cpu_account.c's struct task_rec, one per thread) by thread
group, kept from one pass to the next: a pass sums again only the groups whose records changed.

Passes come in thread id order, so two passes mostly hold the same threads at the same places:
records are compared where they stand, a block of them at a time (memcmp), and only the stretch
between the first and the last thread that came or went is compared as sets. Thousands of
sleeping processes cost a few comparisons of bytes, no Python object each."""

from __future__ import annotations

import struct
from array import array
from typing import Callable

TASK = struct.Struct("<IIQIIQQ16s")  # struct task_rec
_RECORD = struct.Struct(f"{TASK.size}s")
_TGID = struct.Struct("<I")
_WORDS = TASK.size // 8  # u64 words per record; the first holds tgid and tid
_BLOCK = 16  # records compared at once

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
        self.data = b""  # the last pass
        self.groups: dict[int, tuple[bytes, ...]] = {}
        self.retry: set[int] = set()

    def update(self, data: bytes) -> tuple[dict[int, tuple[Leader, int]], set[int]]:
        """Take a pass's output: the groups that changed and can be trusted, tgid -> (leader,
        runtime ns), and the tgids whose leader is gone."""
        gone_records, new_records = changes(self.data, data)
        removed, added = _by_tgid(gone_records), _by_tgid(new_records)
        self.data = data
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


def changes(old: bytes, new: bytes) -> tuple[list[bytes], list[bytes]]:
    """The records of pass `old` that `new` lacks, and those of `new` that `old` lacks."""
    if len(old) % TASK.size or len(new) % TASK.size:
        raise ValueError(f"a pass of {len(new)} bytes is not whole records of {TASK.size}")
    old_ids, new_ids = array("Q", old)[::_WORDS], array("Q", new)[::_WORDS]
    head = _common(old_ids, new_ids, lambda ids, n: ids[:n])
    tail = _common(old_ids[head:], new_ids[head:], lambda ids, n: ids[len(ids) - n :])
    size = TASK.size
    old_end, new_end = len(old) - tail * size, len(new) - tail * size
    gone, came = _in_place(old, new, 0, 0, head)
    tail_gone, tail_came = _in_place(old, new, old_end, new_end, tail)
    gone += tail_gone
    came += tail_came
    between_old = set(_RECORD.iter_unpack(old[head * size : old_end]))
    between_new = set(_RECORD.iter_unpack(new[head * size : new_end]))
    gone += [record for (record,) in between_old - between_new]
    came += [record for (record,) in between_new - between_old]
    return gone, came


def _common(old: array, new: array, part: Callable[[array, int], array]) -> int:
    """How many ids `part` (a head or a tail of that length) shares between `old` and `new`."""
    low, high = 0, min(len(old), len(new))
    while low < high:  # bisection: each comparison is one memcmp of the two parts
        middle = (low + high + 1) // 2
        if part(old, middle) == part(new, middle):
            low = middle
        else:
            high = middle - 1
    return low


def _in_place(
    old: bytes, new: bytes, old_at: int, new_at: int, count: int
) -> tuple[list[bytes], list[bytes]]:
    """The records that differ among `count` that stand for the same threads, from byte
    `old_at` of `old` and `new_at` of `new`: the old ones and the new ones."""
    gone: list[bytes] = []
    came: list[bytes] = []
    size, block = TASK.size, TASK.size * _BLOCK
    end = old_at + count * size
    shift = new_at - old_at
    for start in range(old_at, end, block):
        stop = min(start + block, end)
        if old[start:stop] == new[start + shift : stop + shift]:
            continue
        for at in range(start, stop, size):
            before, after = old[at : at + size], new[at + shift : at + shift + size]
            if before != after:
                gone.append(before)
                came.append(after)
    return gone, came


def _by_tgid(records: list[bytes]) -> dict[int, list[bytes]]:
    found: dict[int, list[bytes]] = {}
    for record in records:
        found.setdefault(_TGID.unpack_from(record)[0], []).append(record)
    return found
