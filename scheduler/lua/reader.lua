-- A job's stream readers, and when the last one left.
-- KEYS: job hash, its readers' leases (sorted set: token -> when the lease ends)
-- ARGV: token ('': a counted reader), lease end (unix time; 0: give it back),
--       now, +1 / -1 (a counted reader attaches / leaves)
-- A stream reader holds a lease under a token of its own, renews it while it
-- reads and gives it back when it leaves; attaching and giving back are
-- idempotent (a retried or failed call can be repeated or undone), and a lease
-- nobody gives back (Redis unreachable then, the web process killed) ends by
-- itself. A counted reader (no token, no lease) holds `held` until it leaves.
-- `detached_at`: when the last reader left, or when the last lease will end
-- (ahead of now while one is held); absent while a counted reader reads. A
-- job's worker cancels an interactive job once now is past it by more than the
-- disconnect grace period.
if redis.call('EXISTS', KEYS[1]) == 0 then
  redis.call('DEL', KEYS[2])
  return false
end
local now = tonumber(ARGV[3])
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', '(' .. ARGV[3])
if ARGV[1] == '' then
  if redis.call('HINCRBY', KEYS[1], 'held', tonumber(ARGV[4])) < 0 then
    redis.call('HSET', KEYS[1], 'held', 0)
  end
elseif tonumber(ARGV[2]) > 0 then
  redis.call('ZADD', KEYS[2], ARGV[2], ARGV[1])
else
  redis.call('ZREM', KEYS[2], ARGV[1])
end
local held = tonumber(redis.call('HGET', KEYS[1], 'held') or '0')
local leased = redis.call('ZCARD', KEYS[2])
redis.call('HSET', KEYS[1], 'readers', held + leased)
if held > 0 then
  redis.call('HDEL', KEYS[1], 'detached_at')
elseif leased > 0 then
  local last = redis.call('ZRANGE', KEYS[2], -1, -1, 'WITHSCORES')[2]
  redis.call('HSET', KEYS[1], 'detached_at', last)
  redis.call('EXPIREAT', KEYS[2], math.floor(tonumber(last)) + 2)
else
  redis.call('DEL', KEYS[2])
  local was = redis.call('HGET', KEYS[1], 'detached_at')
  if not was or tonumber(was) > now then
    redis.call('HSET', KEYS[1], 'detached_at', ARGV[3])
  end
end
return held + leased
