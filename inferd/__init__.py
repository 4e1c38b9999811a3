"""inferd: an LLM inference service (engine, API, gateway, cluster)."""

__version__ = "0.1.0"
