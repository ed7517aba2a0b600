-- Enqueue a new job atomically: job hash, waiting set, job index, wake-up.
-- KEYS: job hash, queue zset, wake list, jobs index zset
-- ARGV: id, score, created_at, field, value, field, value, ...
if redis.call('EXISTS', KEYS[1]) == 1 then
  return 0
end
redis.call('HSET', KEYS[1], unpack(ARGV, 4))
redis.call('ZADD', KEYS[2], ARGV[2], ARGV[1])
redis.call('ZADD', KEYS[4], ARGV[3], ARGV[1])
redis.call('LPUSH', KEYS[3], ARGV[1])
redis.call('LTRIM', KEYS[3], 0, 63)
return 1
