"""Worker processes on this machine: start, watch, restart (supervisor.py)."""
