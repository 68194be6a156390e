"""Sleeping child processes for the benchmarks, forked by a small C program, gone with it."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
from pathlib import Path
from typing import Iterator

# argv: count, seconds. Forks `count` children that sleep until killed, their parent dies, or
# `seconds` pass; prints "ready N" and their pids on one line, and kills them all when stdin
# closes (also when whoever started it dies).
SLEEPERS_C = r"""
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

int main(int argc, char **argv) {
    int n = atoi(argv[1]), started = 0;
    pid_t parent = getpid(), *children = calloc(n, sizeof(pid_t));
    char byte;
    for (; started < n; started++) {
        pid_t pid = fork();
        if (pid == 0) {
            prctl(PR_SET_PDEATHSIG, SIGKILL);
            if (getppid() != parent) _exit(0);
            alarm(atoi(argv[2]));
            pause();
            _exit(0);
        }
        if (pid < 0) break;
        children[started] = pid;
    }
    printf("ready %d", started);
    for (int i = 0; i < started; i++) printf(" %d", children[i]);
    printf("\n");
    fflush(stdout);
    while (read(0, &byte, 1) > 0) {}
    for (int i = 0; i < started; i++) kill(children[i], SIGKILL);
    while (wait(NULL) > 0) {}
    return 0;
}
"""


def build(directory: Path, name: str, text: str) -> Path:
    """Compile the C program `text` into `directory/name`."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise SystemExit("a C compiler is needed (apt-get install gcc)")
    source, binary = directory / f"{name}.c", directory / name
    source.write_text(text)
    subprocess.run([compiler, "-O2", "-o", str(binary), str(source)], check=True)
    return binary


@contextlib.contextmanager
def sleepers(binary: Path, count: int, seconds: int) -> Iterator[list[int]]:
    """`count` sleeping processes (fewer where fork fails) for at most `seconds`: their pids."""
    spawner = subprocess.Popen(
        [str(binary), str(count), str(seconds)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert spawner.stdin is not None and spawner.stdout is not None  # both piped
    try:
        yield [int(pid) for pid in spawner.stdout.readline().split()[2:]]
    finally:
        spawner.stdin.close()
        try:
            spawner.wait(60)
        except subprocess.TimeoutExpired:
            spawner.kill()
            spawner.wait()
