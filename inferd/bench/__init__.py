"""`inferd bench`: load generation against an OpenAI-compatible server (see loadgen.py)."""
