"""A command that reports 256 devices never seen before on every run: worker RSS and the size of
the counter state over time.

Prints one row per measurement. Target (issue 17): RSS and state size flat over 5 minutes of such
churn (devices gone for --device-grace are forgotten, at most 256 absent ones are kept).
"""

from __future__ import annotations

import argparse
import shlex
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from agent import Agent  # noqa: E402
from kepler_bridge.sampling import state_file  # noqa: E402

# `count` devices that no run before listed: uuids from a run counter kept in the file "$1".
INVENTING = """\
n=$(( $(cat "$1") + 1 )); echo $n > "$1"
printf '{"devices":['
i=1
while [ $i -le %d ]; do
  [ $i = 1 ] || printf ,
  printf '{"uuid":"new-%%d-%%d","usedMemory":1,"totalMemory":2,"power":50,"energy":%%d}' $n $i $n
  i=$((i + 1))
done
echo ']}'
"""


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--minutes", type=float, default=5.0)
    parser.add_argument("--every", type=float, default=30.0, help="seconds between rows")
    parser.add_argument("--devices", type=int, default=256, help="new devices per run")
    return parser.parse_args()


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for {pid}")


def main() -> None:
    args = arguments()
    work = Path(tempfile.mkdtemp(prefix="kb-churn-"))
    script, runs = work / "inventing.sh", work / "runs"
    script.write_text(INVENTING % args.devices)
    runs.write_text("0")
    command = shlex.join(["sh", str(script), str(runs)])
    with Agent("--sources", "command", "--command", command, "--interval", "1s") as agent:
        assert agent.process is not None  # started by the with
        (state,) = [
            path / state_file.FILE
            for place in ("/dev/shm", tempfile.gettempdir())
            for path in Path(place).glob(f"kepler-bridge-{agent.process.pid}-*")
        ]
        log = state.with_name(state_file.LOG)
        (worker,) = agent.worker_pids()
        started = time.monotonic()
        print(f"{'seconds':>7}  {'devices invented':>16}  {'worker RSS':>10}  {'state files':>11}")
        while True:
            elapsed = time.monotonic() - started
            invented = int(runs.read_text()) * args.devices
            size = sum(path.stat().st_size for path in (state, log) if path.exists()) / 1024
            print(f"{elapsed:7.0f}  {invented:16d}  {rss_mib(worker):6.1f} MiB  {size:7.1f} KiB")
            if elapsed >= args.minutes * 60:
                break
            time.sleep(args.every)


if __name__ == "__main__":
    main()
