#!/usr/bin/env python3
"""Reuse a BIE custom accelerator collector with kepler-bridge's command source.

A collector written for the BIE "custom accelerator" guide answers GET /v1/collect with
{"<node>": {"deviceNum", "devices": [{"usedMemory", "totalMemory", "percent"}], ...}}; the command
source accepts that body as it is. This script fetches it and prints it, so the collector can keep
running (on another port) while kepler-bridge serves port 30060 with every other accelerator:

    kepler-bridge serve --command "/opt/kepler-bridge/bie-collector.py http://127.0.0.1:30061/v1/collect"
"""

import json
import sys
import urllib.request

TIMEOUT_SECONDS = 3


def main() -> int:
    if len(sys.argv) != 2:
        sys.stderr.write("usage: bie-collector.py URL-of-the-collector's-/v1/collect\n")
        return 2
    try:
        with urllib.request.urlopen(sys.argv[1], timeout=TIMEOUT_SECONDS) as response:
            body = json.load(response)
    except (OSError, ValueError) as err:
        sys.stderr.write(f"cannot read {sys.argv[1]}: {err}\n")
        return 1
    json.dump(body, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
