#!/bin/sh
# A starting point for kepler-bridge's command source (docs/command-source.md): print one JSON object
# with a "devices" list, in contract units (bytes, ratios 0..1, celsius, watts, joules, hertz), then exit 0.
# Replace the fixed numbers with what your accelerator's tool reports; leave out what it cannot tell.
#
#   kepler-bridge serve --command /opt/kepler-bridge/template.sh
set -eu

used_bytes=1073741824       # e.g. from your vendor tool's memory query, converted to bytes
total_bytes=8589934592
busy_ratio=0.25             # a percentage divided by 100
temperature_celsius=48
power_watts=7.5

cat <<JSON
{"devices": [
  {"uuid": "EXAMPLE-0000:01:00.0", "vendor": "example", "model": "Example NPU", "pciBusId": "0000:01:00.0",
   "usedMemory": $used_bytes, "totalMemory": $total_bytes, "utilization": $busy_ratio,
   "temperature": $temperature_celsius, "power": $power_watts}
]}
JSON
