"""The ebpf source (per-process CPU time from the kernel's own runtime) and the pieces it loads
and reads with.

source.py is the source; loader.py the short-lived child that runs bcc (it imports btf.py by
path); bpf_syscall.py the bpf(2) calls the worker makes on the descriptors it inherits; btf.py the
struct offsets from the running kernel's BTF; kernel_headers.py the header tree bcc compiles
against.
The C program lives in bpf/cpu_account.c.
"""
