"""Allows `python -m kepler_bridge`."""

from kepler_bridge.cli import main

raise SystemExit(main())
