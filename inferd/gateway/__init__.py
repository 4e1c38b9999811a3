"""The gateway: what stands between the API and the workers. Today the router; the gateway issue brings tenants and
keys, quotas, the waiting queue, admission control and failover."""
