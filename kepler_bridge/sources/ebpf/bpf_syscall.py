"""The few bpf(2) commands the agent needs: read maps and run iterators it holds by file descriptor.

No bcc or LLVM here: the agent process keeps only program, map and attachment
descriptors (see loader.py) and drains maps with these calls.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
from dataclasses import dataclass
from typing import Iterator

_NR_BPF = {"x86_64": 321, "aarch64": 280, "ppc64le": 361, "s390x": 351, "riscv64": 280}

MAP_LOOKUP_ELEM = 1
MAP_DELETE_ELEM = 3
MAP_GET_NEXT_KEY = 4
OBJ_GET_INFO_BY_FD = 15
MAP_LOOKUP_AND_DELETE_BATCH = 25
ITER_CREATE = 33

# Unknown command (old kernel) or a map type without batch support (524 is the kernel's ENOTSUPP).
_BATCH_UNSUPPORTED = (errno.EINVAL, errno.EOPNOTSUPP, 524)

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


class _ElemAttr(ctypes.Structure):
    _fields_ = [
        ("map_fd", ctypes.c_uint32),
        ("pad", ctypes.c_uint32),
        ("key", ctypes.c_uint64),
        ("value", ctypes.c_uint64),
        ("flags", ctypes.c_uint64),
    ]


class _BatchAttr(ctypes.Structure):
    _fields_ = [
        ("in_batch", ctypes.c_uint64),
        ("out_batch", ctypes.c_uint64),
        ("keys", ctypes.c_uint64),
        ("values", ctypes.c_uint64),
        ("count", ctypes.c_uint32),
        ("map_fd", ctypes.c_uint32),
        ("elem_flags", ctypes.c_uint64),
        ("flags", ctypes.c_uint64),
    ]


class _InfoAttr(ctypes.Structure):
    _fields_ = [
        ("bpf_fd", ctypes.c_uint32),
        ("info_len", ctypes.c_uint32),
        ("info", ctypes.c_uint64),
    ]


class _IterCreateAttr(ctypes.Structure):
    _fields_ = [("link_fd", ctypes.c_uint32), ("flags", ctypes.c_uint32)]


class _MapInfo(ctypes.Structure):
    _fields_ = [
        ("type", ctypes.c_uint32),
        ("id", ctypes.c_uint32),
        ("key_size", ctypes.c_uint32),
        ("value_size", ctypes.c_uint32),
        ("max_entries", ctypes.c_uint32),
        ("map_flags", ctypes.c_uint32),
        ("name", ctypes.c_char * 16),
    ]


class _ProgInfo(ctypes.Structure):
    # struct bpf_prog_info up to recursion_misses (kernel 5.12+); older kernels leave the tail zero.
    _fields_ = [
        ("type", ctypes.c_uint32),
        ("id", ctypes.c_uint32),
        ("tag", ctypes.c_uint8 * 8),
        ("jited_prog_len", ctypes.c_uint32),
        ("xlated_prog_len", ctypes.c_uint32),
        ("jited_prog_insns", ctypes.c_uint64),
        ("xlated_prog_insns", ctypes.c_uint64),
        ("load_time", ctypes.c_uint64),
        ("created_by_uid", ctypes.c_uint32),
        ("nr_map_ids", ctypes.c_uint32),
        ("map_ids", ctypes.c_uint64),
        ("name", ctypes.c_char * 16),
        ("ifindex", ctypes.c_uint32),
        ("gpl_compatible", ctypes.c_uint32),
        ("netns_dev", ctypes.c_uint64),
        ("netns_ino", ctypes.c_uint64),
        ("nr_jited_ksyms", ctypes.c_uint32),
        ("nr_jited_func_lens", ctypes.c_uint32),
        ("jited_ksyms", ctypes.c_uint64),
        ("jited_func_lens", ctypes.c_uint64),
        ("btf_id", ctypes.c_uint32),
        ("func_info_rec_size", ctypes.c_uint32),
        ("func_info", ctypes.c_uint64),
        ("nr_func_info", ctypes.c_uint32),
        ("nr_line_info", ctypes.c_uint32),
        ("line_info", ctypes.c_uint64),
        ("jited_line_info", ctypes.c_uint64),
        ("nr_jited_line_info", ctypes.c_uint32),
        ("line_info_rec_size", ctypes.c_uint32),
        ("jited_line_info_rec_size", ctypes.c_uint32),
        ("nr_prog_tags", ctypes.c_uint32),
        ("prog_tags", ctypes.c_uint64),
        ("run_time_ns", ctypes.c_uint64),
        ("run_cnt", ctypes.c_uint64),
        ("recursion_misses", ctypes.c_uint64),
    ]


def _bpf(cmd: int, attr: ctypes.Structure) -> int:
    number = _NR_BPF.get(platform.machine())
    if number is None:
        raise OSError(errno.ENOSYS, f"bpf(2) syscall number unknown for {platform.machine()}")
    result = _libc.syscall(number, cmd, ctypes.byref(attr), ctypes.sizeof(attr))
    if result < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return result


def _address(buffer: ctypes.Array) -> int:
    return ctypes.addressof(buffer)


@dataclass(frozen=True)
class ProgStats:
    """A program's identity and kernel run-time statistics (counted while
    kernel.bpf_stats_enabled=1)."""

    id: int
    name: str
    run_time_ns: int
    run_cnt: int


def prog_stats(fd: int) -> ProgStats:
    """Read id, name and run-time statistics of the program behind fd."""
    info = _ProgInfo()
    _bpf(OBJ_GET_INFO_BY_FD, _InfoAttr(fd, ctypes.sizeof(info), ctypes.addressof(info)))
    return ProgStats(info.id, info.name.decode(errors="replace"), info.run_time_ns, info.run_cnt)


def read_iterator(link_fd: int, chunk: int = 1 << 17) -> bytes:
    """Run one pass of the BPF iterator behind link_fd (BPF_ITER_CREATE, then read to the end)
    and return its output."""
    fd = _bpf(ITER_CREATE, _IterCreateAttr(link_fd, 0))
    try:
        parts: list[bytes] = []
        while True:
            part = os.read(fd, chunk)
            if not part:
                return b"".join(parts)
            parts.append(part)
    finally:
        os.close(fd)


class BpfMap:
    """A map held by file descriptor (the program's maps are plain hash and array maps, not
    per-CPU ones)."""

    def __init__(self, fd: int) -> None:
        info = _MapInfo()
        _bpf(OBJ_GET_INFO_BY_FD, _InfoAttr(fd, ctypes.sizeof(info), ctypes.addressof(info)))
        self.fd = fd
        self.name = info.name.decode(errors="replace")
        self.type = info.type
        self.key_size = info.key_size
        self.value_size = info.value_size
        self.max_entries = info.max_entries
        self._batch_supported = True

    def lookup(self, key: bytes) -> bytes | None:
        """The value under key, or None when absent."""
        key_buf = ctypes.create_string_buffer(key, self.key_size)
        value_buf = ctypes.create_string_buffer(self.value_size)
        try:
            _bpf(MAP_LOOKUP_ELEM, _ElemAttr(self.fd, 0, _address(key_buf), _address(value_buf), 0))
        except FileNotFoundError:
            return None
        return value_buf.raw

    def drain(self, chunk: int = 1024) -> Iterator[tuple[bytes, bytes]]:
        """Take every entry out of a hash map: yields (key, value) and deletes it.

        Uses BPF_MAP_LOOKUP_AND_DELETE_BATCH (kernel 5.6+), which copies and
        deletes each bucket atomically, so no increment is lost; older kernels
        get a per-key lookup then delete.
        """
        if self._batch_supported:
            try:
                yield from self._drain_batch(chunk)
                return
            except OSError as err:
                if err.errno not in _BATCH_UNSUPPORTED:
                    raise
                self._batch_supported = False
        yield from self._drain_each()

    def _drain_batch(self, chunk: int) -> Iterator[tuple[bytes, bytes]]:
        keys = ctypes.create_string_buffer(self.key_size * chunk)
        values = ctypes.create_string_buffer(self.value_size * chunk)
        token_in = ctypes.create_string_buffer(8)
        token_out = ctypes.create_string_buffer(8)
        first = True
        while True:
            attr = _BatchAttr(
                0 if first else _address(token_in),
                _address(token_out),
                _address(keys),
                _address(values),
                chunk,
                self.fd,
                0,
                0,
            )
            done = False
            try:
                _bpf(MAP_LOOKUP_AND_DELETE_BATCH, attr)
            except FileNotFoundError:
                done = True
            # One copy of each buffer's filled part (`raw` copies all of it at every access).
            taken_keys = ctypes.string_at(keys, attr.count * self.key_size)
            taken_values = ctypes.string_at(values, attr.count * self.value_size)
            key_size, size = self.key_size, self.value_size
            for index in range(attr.count):
                yield (
                    taken_keys[index * key_size : (index + 1) * key_size],
                    taken_values[index * size : (index + 1) * size],
                )
            if done:
                return
            ctypes.memmove(token_in, token_out, 8)
            first = False

    def _drain_each(self) -> Iterator[tuple[bytes, bytes]]:
        for key in list(self.keys()):
            value = self.lookup(key)
            self.delete(key)
            if value is not None:
                yield key, value

    def keys(self) -> Iterator[bytes]:
        """Every key currently in a hash map."""
        current = ctypes.create_string_buffer(self.key_size)
        following = ctypes.create_string_buffer(self.key_size)
        first = True
        while True:
            try:
                _bpf(
                    MAP_GET_NEXT_KEY,
                    _ElemAttr(
                        self.fd, 0, 0 if first else _address(current), _address(following), 0
                    ),
                )
            except FileNotFoundError:
                return
            yield following.raw
            ctypes.memmove(current, following, self.key_size)
            first = False

    def delete(self, key: bytes) -> None:
        """Remove key; absent keys are fine."""
        key_buf = ctypes.create_string_buffer(key, self.key_size)
        try:
            _bpf(MAP_DELETE_ELEM, _ElemAttr(self.fd, 0, _address(key_buf), 0, 0))
        except FileNotFoundError:
            pass
