-- Enqueue a new job atomically: job hash, waiting set, wake-up.
-- KEYS: job hash, queue zset, wake list
-- ARGV: id, score, created_at, queue limit (0: none), field, value, ...
-- Returns 1 when enqueued, 0 when the id is taken, -1 when the queue is full.
if redis.call('EXISTS', KEYS[1]) == 1 then
  return 0
end
local limit = tonumber(ARGV[4])
if limit > 0 and redis.call('ZCARD', KEYS[2]) >= limit then
  return -1
end
redis.call('HSET', KEYS[1], unpack(ARGV, 5))
redis.call('ZADD', KEYS[2], ARGV[2], ARGV[1])
redis.call('LPUSH', KEYS[3], ARGV[1])
redis.call('LTRIM', KEYS[3], 0, 63)
return 1
