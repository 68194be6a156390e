"""Byte offsets of kernel struct members from the running kernel's BTF (/sys/kernel/btf/vmlinux).

The BPF programs read kernel structs only at offsets found here, so headers of
another kernel version cannot make them misread a field. Standard library
only: the eBPF loader child imports this file by path.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

BTF_PATH = "/sys/kernel/btf/vmlinux"
_MAGIC = 0xEB9F
# Kinds (include/uapi/linux/btf.h).
_INT, _PTR, _ARRAY, _STRUCT, _UNION, _ENUM, _FUNC, _FLOAT, _ENUM64 = 1, 2, 3, 4, 5, 6, 12, 16, 19
_MODIFIERS = (8, 9, 10, 11, 18)  # typedef, volatile, const, restrict, type tag
# Bytes after struct btf_type: fixed per kind, or per member (vlen) for the kinds in _PER_MEMBER.
_EXTRA = {1: 4, 3: 12, 4: 12, 5: 12, 6: 8, 13: 8, 14: 4, 15: 12, 17: 4, 19: 12}
_PER_MEMBER = {4, 5, 6, 13, 15, 19}
_TYPE = struct.Struct("<III")
_POINTER_SIZE = struct.calcsize("P")


class BtfError(Exception):
    """The BTF lacks a struct or member, or is not BTF; the message names what and where."""


@dataclass(frozen=True)
class Member:
    """Where a (possibly nested) member lies in its outermost struct, and how many bytes it has."""

    offset: int
    size: int


class Btf:
    """The types of one BTF blob, indexed by id, with struct and function lookup by name."""

    def __init__(self, data: bytes, origin: str = BTF_PATH) -> None:
        if len(data) < 24 or struct.unpack_from("<H", data)[0] != _MAGIC:
            raise BtfError(f"{origin} is not BTF (bad magic)")
        _, _, _, header, type_off, type_len, str_off, str_len = struct.unpack_from(
            "<HBBIIIII", data
        )
        self.data, self.origin = data, origin
        self._strings = (header + str_off, header + str_off + str_len)
        self._positions = [0]  # type id 0 is void
        self._named: dict[tuple[int, str], int] = {}
        pos, end = header + type_off, header + type_off + type_len
        while pos < end:
            self._positions.append(pos)
            name_off, info, _ = _TYPE.unpack_from(data, pos)
            kind, vlen = info >> 24 & 0x1F, info & 0xFFFF
            if name_off and kind in (_STRUCT, _UNION, _FUNC) and (vlen or kind == _FUNC):
                self._named.setdefault((kind, self._name(name_off)), len(self._positions) - 1)
            extra = _EXTRA.get(kind, 0)
            pos += 12 + (extra * vlen if kind in _PER_MEMBER else extra)

    @classmethod
    def load(cls, path: str = BTF_PATH) -> "Btf":
        """Read and index a BTF file; OSError when it cannot be read."""
        with open(path, "rb") as file:
            return cls(file.read(), path)

    def _name(self, offset: int) -> str:
        start = self._strings[0] + offset
        return self.data[start : self.data.index(b"\0", start)].decode(errors="replace")

    def _type(self, type_id: int) -> tuple[int, int, int, int, int]:
        """name_off, kind, vlen, kind_flag, size_or_type of a type id."""
        name_off, info, size = _TYPE.unpack_from(self.data, self._positions[type_id])
        return name_off, info >> 24 & 0x1F, info & 0xFFFF, info >> 31, size

    def _resolve(self, type_id: int) -> int:
        """The type behind typedefs and qualifiers."""
        while self._type(type_id)[1] in _MODIFIERS:
            type_id = self._type(type_id)[4]
        return type_id

    def has_function(self, name: str) -> bool:
        """Whether the kernel has a function of this name (iterator targets are functions
        bpf_iter_<target>)."""
        return (_FUNC, name) in self._named

    def size(self, type_id: int) -> int:
        """Size in bytes of a type."""
        type_id = self._resolve(type_id)
        _, kind, _, _, size = self._type(type_id)
        if kind == _PTR:
            return _POINTER_SIZE
        if kind == _ARRAY:
            element, _, count = struct.unpack_from("<III", self.data, self._positions[type_id] + 12)
            return self.size(element) * count
        return size if kind in (_INT, _STRUCT, _UNION, _ENUM, _FLOAT, _ENUM64) else 0

    def member(self, struct_name: str, path: str) -> Member:
        """Offset and size of struct_name.path, where path may name embedded members
        ("se.sum_exec_runtime")."""
        type_id = self._named.get((_STRUCT, struct_name))
        if type_id is None:
            raise BtfError(f"{self.origin} has no struct {struct_name}")
        offset = 0
        for name in path.split("."):
            found = self._find(type_id, name)
            if found is None:
                raise BtfError(f"{self.origin}: struct {struct_name} has no member {path}")
            bits, type_id = found
            if bits % 8:
                raise BtfError(f"{self.origin}: {struct_name}.{path} is a bit field")
            offset += bits // 8
            type_id = self._resolve(type_id)
        return Member(offset, self.size(type_id))

    def _find(self, type_id: int, name: str) -> tuple[int, int] | None:
        """Bit offset and type of a member, looking into anonymous structs and unions (randomized
        layouts use them)."""
        _, kind, vlen, bitfields, _ = self._type(type_id)
        if kind not in (_STRUCT, _UNION):
            return None
        for index in range(vlen):
            name_off, member_type, offset = _TYPE.unpack_from(
                self.data, self._positions[type_id] + 12 + 12 * index
            )
            bits = offset & 0xFFFFFF if bitfields else offset
            if name_off and self._name(name_off) == name:
                return bits, member_type
            if not name_off:
                inner = self._find(self._resolve(member_type), name)
                if inner is not None:
                    return bits + inner[0], inner[1]
        return None
