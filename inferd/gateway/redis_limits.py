"""The Redis backend of the per-tenant limits: several gateway processes (or hosts) share one RPM, TPM and
concurrency limit per tenant, exactly.

It owns, per tenant, three keys that share the hash tag `{tenant}` (so they would sit on one Redis Cluster slot, as
a multi-key script needs):

- `<prefix>:{<tenant>}:req` and `<prefix>:{<tenant>}:tok`: the request and token buckets, hashes with `level` (a
  double) and `at` (Redis' TIME in integer microseconds). A missing bucket is a full one, so each key expires
  2 x window after its last write (a bucket is full again after one window): idle tenants leave nothing behind.
- `<prefix>:{<tenant>}:leases`: the concurrency slots, a sorted set of lease ids scored by their expiry (now +
  lease_s, in microseconds). Expired members are pruned before counting, so a gateway that died mid-request
  gives its slots back after lease_s instead of never; a live gateway renews the leases of its running requests
  (`renew`) well before that.

Redis down or failing: every call raises LimiterUnavailable (the API answers 503 with Retry-After) within the socket
timeout (the client does not retry on its own). `settle` refunds only when it removes the lease, so a settlement
retried after a lost reply never refunds twice (a lease that expired first, Redis unreachable for over lease_s,
refunds nothing: the tenant is charged its reservation). `renew` extends the leases of every tenant in one pipeline.

`reserve` and `settle` are each one Lua script, so a reservation (refill both buckets, check every limit, take all or
nothing) is atomic across every process, and every refill uses Redis' own clock: no process's clock matters. The
semantics and the numbers of the Decision (retry_after, remaining, reset) are those of `InProcessLimiter` in
inferd/gateway/limits.py. Needs Redis >= 5 (scripts replicated by their effects, so a script may call TIME and
then write).
"""

from __future__ import annotations

import math
import re

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from inferd.config import REDIS_LEASE_S, REDIS_RETRY_AFTER_S, REDIS_SOCKET_TIMEOUT_S
from inferd.gateway.limits import Decision, LimiterUnavailable, TenantLimits

# Shared by both scripts. Times are integer microseconds (TIME's seconds * 1e6 + microseconds ~ 1.8e15 < 2^53, so
# exact in Lua's doubles); levels are doubles, written with %.17g so that a write and a read give the same number.
_COMMON = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local window = tonumber(ARGV[1])
local bucket_ttl_ms = tonumber(ARGV[2])

local function num(x) return string.format('%.17g', x) end

-- the level of a bucket refilled up to now (capacity / window per second); a missing bucket is full
local function level_of(key, capacity)
  local v = redis.call('HMGET', key, 'level', 'at')
  local level, at = tonumber(v[1]), tonumber(v[2])
  if level == nil or at == nil then return capacity end
  local elapsed = now - at
  if elapsed < 0 then elapsed = 0 end  -- a failover to a replica whose clock is behind: no refill, never a drain
  return math.min(capacity, level + capacity / window * elapsed / 1000000)
end

local function store(key, level)
  redis.call('HSET', key, 'level', num(level), 'at', num(now))
  redis.call('PEXPIRE', key, bucket_ttl_ms)
end
"""

# KEYS: request bucket, token bucket, leases. ARGV: window_s, bucket_ttl_ms, rpm, tpm, max_concurrency (-1 =
# unlimited: that bucket is not read nor written), tokens, lease_id, lease_us, leases_ttl_ms.
# Returns strings (a number in a Lua reply would be truncated to an integer): allowed (0/1), reason ('' = none),
# retry_after, remaining_requests, reset_requests, remaining_tokens, reset_tokens ('' where that limit is None).
_RESERVE = _COMMON + """
local rpm, tpm, max_concurrency = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
local tokens = tonumber(ARGV[6])
local lease_id = ARGV[7]
local lease_us = tonumber(ARGV[8])
local leases_ttl_ms = tonumber(ARGV[9])

local req, tok
if rpm >= 0 then req = level_of(KEYS[1], rpm) end
if tpm >= 0 then tok = level_of(KEYS[2], tpm) end
-- leases of a gateway that died expire here
redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now)

local allowed, reason, retry = 1, '', 0
-- the longest wait wins, ties to the greater reason: Python's max() over (wait, reason) in InProcessLimiter
local function refuse(wait, why)
  if allowed == 1 or wait > retry or (wait == retry and why > reason) then
    allowed, retry, reason = 0, wait, why
  end
end
if tok ~= nil and tokens > tpm then
  allowed, reason = 0, 'too_large'  -- would never fit: no retry_after
else
  if req ~= nil and req < 1 then refuse((1 - req) / (rpm / window), 'requests') end
  if tok ~= nil and tok < tokens then refuse((tokens - tok) / (tpm / window), 'tokens') end
  -- a slot frees when a request ends: no rate to compute a wait from
  if max_concurrency >= 0 and redis.call('ZCARD', KEYS[3]) >= max_concurrency then refuse(1.0, 'concurrency') end
end

if allowed == 1 then  -- all or nothing: no bucket was written before this point
  if req ~= nil then req = req - 1; store(KEYS[1], req) end
  if tok ~= nil then tok = tok - tokens; store(KEYS[2], tok) end
  -- held even without a concurrency limit, as InProcessLimiter does: a limit set later counts the running ones
  redis.call('ZADD', KEYS[3], now + lease_us, lease_id)
  -- the newest member expires last (same lease_s everywhere): the key outlives every live lease
  redis.call('PEXPIRE', KEYS[3], leases_ttl_ms)
end

local out = {tostring(allowed), reason, num(retry), '', '', '', ''}
if req ~= nil then out[4] = num(math.floor(req)); out[5] = num((rpm - req) / (rpm / window)) end
if tok ~= nil then out[6] = num(math.floor(tok)); out[7] = num((tpm - tok) / (tpm / window)) end
return out
"""

# KEYS: request bucket, token bucket, leases. ARGV: window_s, bucket_ttl_ms, rpm, tpm (-1 = unlimited), refund
# (tokens), refund_request (0/1), lease_id.
_SETTLE = _COMMON + """
local rpm, tpm = tonumber(ARGV[3]), tonumber(ARGV[4])
local refund, refund_request = tonumber(ARGV[5]), tonumber(ARGV[6])
-- idempotent: only the call that removes the lease refunds (a retry after a lost reply finds it gone)
if redis.call('ZREM', KEYS[3], ARGV[7]) == 0 then return 0 end
if tpm >= 0 and refund > 0 then store(KEYS[2], math.min(tpm, level_of(KEYS[2], tpm) + refund)) end
if rpm >= 0 and refund_request == 1 then store(KEYS[1], math.min(rpm, level_of(KEYS[1], rpm) + 1)) end
return 1
"""

# KEYS: leases. ARGV: lease_us, leases_ttl_ms, lease ids... Extends the leases that still exist (XX: a settled or
# expired one is not brought back).
_RENEW = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local lease_us, leases_ttl_ms = tonumber(ARGV[1]), tonumber(ARGV[2])
local renewed = 0
for i = 3, #ARGV do
  renewed = renewed + redis.call('ZADD', KEYS[1], 'XX', 'CH', now + lease_us, ARGV[i])
end
if renewed > 0 then redis.call('PEXPIRE', KEYS[1], leases_ttl_ms) end
return renewed
"""


class RedisUnavailable(RuntimeError):
    """Redis could not be reached (or answered an error) at start-up."""


def _redact(url: str) -> str:
    """The URL without its password, for error messages and logs."""
    return re.sub(r"//([^:@/]*):[^@/]*@", r"//\1:***@", url)


def _unavailable(error: BaseException) -> LimiterUnavailable:
    """What a failed Redis call raises: the error's type only, never its text (it names the host: it reaches
    clients)."""
    return LimiterUnavailable(f"the rate-limit store is unavailable ({type(error).__name__})", REDIS_RETRY_AFTER_S)


def _limit(value: int | None, name: str, minimum: int) -> int:
    """A limit as a script argument: -1 = unlimited. A rate of 0 would divide by zero, so RPM and TPM are >= 1."""
    if value is None:
        return -1
    if int(value) != value or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum} or None (unlimited), not {value!r}")
    return int(value)


def _opt_int(text: str) -> int | None:
    return None if text == "" else int(float(text))


def _opt_float(text: str) -> float:
    return 0.0 if text == "" else float(text)


class RedisLimiter:
    """Per-tenant RPM/TPM buckets and concurrency slots in Redis, shared by every process that uses the same URL and
    prefix. Same contract as InProcessLimiter (inferd.gateway.limits.Limiter)."""

    def __init__(self, url: str, window: float = 60.0, lease_s: float = REDIS_LEASE_S, prefix: str = "inferd"):
        if window <= 0:
            raise ValueError("the rate window must be > 0 seconds")
        if lease_s <= 0:
            raise ValueError("the lease of a concurrency slot must be > 0 seconds")
        self.window = float(window)
        self.lease_s = float(lease_s)
        self.prefix = prefix
        self.url = url
        # a bucket is full again one window after its last write, so past 2 windows its key is worth nothing
        self._bucket_ttl_ms = max(1, math.ceil(2 * self.window * 1000))
        self._lease_us = math.ceil(self.lease_s * 1_000_000)
        self._leases_ttl_ms = math.ceil(self.lease_s * 1000) + 1000
        # decode_responses: the scripts answer strings; the connection pool is shared by every task of this process
        # no retries inside the client: a dead or silent Redis fails the call within one socket timeout (the gateway
        # answers 503 with Retry-After; settlements and renewals are retried by their own loops)
        self._redis = aioredis.Redis.from_url(url, decode_responses=True, socket_timeout=REDIS_SOCKET_TIMEOUT_S,
                                              socket_connect_timeout=REDIS_SOCKET_TIMEOUT_S,
                                              retry=Retry(NoBackoff(), 0))
        # EVALSHA, with a SCRIPT LOAD on NOSCRIPT (a restarted or failed-over Redis forgets its scripts)
        self._reserve = self._redis.register_script(_RESERVE)
        self._settle = self._redis.register_script(_SETTLE)
        self._renew = self._redis.register_script(_RENEW)

    async def _call(self, script, keys: list[str], args: list):
        try:
            return await script(keys=keys, args=args)
        except (RedisError, OSError, TimeoutError) as e:
            raise _unavailable(e) from e

    def _keys(self, tenant: str) -> list[str]:
        base = f"{self.prefix}:{{{tenant}}}"
        return [f"{base}:req", f"{base}:tok", f"{base}:leases"]

    async def ping(self) -> None:
        """Raises RedisUnavailable, with the (redacted) URL, when Redis cannot be reached: checked at start-up so that
        a wrong --redis-url fails there and not on the first request."""
        try:
            await self._redis.ping()
        except (RedisError, OSError) as e:
            raise RedisUnavailable(f"cannot reach Redis at {_redact(self.url)}: {e}") from e

    async def reserve(self, tenant: str, limits: TenantLimits, lease_id: str, tokens: int) -> Decision:
        if tokens < 0:  # would raise the bucket above its capacity
            raise ValueError(f"cannot reserve a negative number of tokens ({tokens})")
        args = [self.window, self._bucket_ttl_ms, _limit(limits.rpm, "rpm", 1), _limit(limits.tpm, "tpm", 1),
                _limit(limits.max_concurrency, "max_concurrency", 0), int(tokens), lease_id, self._lease_us,
                self._leases_ttl_ms]
        allowed, reason, retry, rem_req, reset_req, rem_tok, reset_tok = await self._call(
            self._reserve, self._keys(tenant), args)
        return Decision(allowed=allowed == "1", reason=reason or None, retry_after=float(retry),
                        limit_requests=limits.rpm, remaining_requests=_opt_int(rem_req),
                        reset_requests=_opt_float(reset_req), limit_tokens=limits.tpm,
                        remaining_tokens=_opt_int(rem_tok), reset_tokens=_opt_float(reset_tok))

    async def settle(self, tenant: str, limits: TenantLimits, lease_id: str, reserved_tokens: int,
                     used_tokens: int, refund_request: bool = False) -> None:
        args = [self.window, self._bucket_ttl_ms, _limit(limits.rpm, "rpm", 1), _limit(limits.tpm, "tpm", 1),
                max(0, int(reserved_tokens) - int(used_tokens)), 1 if refund_request else 0, lease_id]
        await self._call(self._settle, self._keys(tenant), args)

    async def renew(self, leases: list[tuple[str, str]]) -> None:
        by_tenant: dict[str, list[str]] = {}
        for tenant, lease_id in leases:
            by_tenant.setdefault(tenant, []).append(lease_id)
        if not by_tenant:
            return
        try:  # one pipeline for every tenant: one round trip (plus a SCRIPT EXISTS) per renewal period
            async with self._redis.pipeline(transaction=False) as pipe:
                for tenant, ids in by_tenant.items():
                    await self._renew(keys=[self._keys(tenant)[2]], args=[self._lease_us, self._leases_ttl_ms, *ids],
                                      client=pipe)
                await pipe.execute()
        except (RedisError, OSError, TimeoutError) as e:
            raise _unavailable(e) from e

    async def close(self) -> None:
        await self._redis.aclose()
