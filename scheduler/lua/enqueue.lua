-- Enqueue a new job atomically: job hash, waiting set, wake-up.
-- KEYS: job hash, queue zset, wake list, fair hash (lib.lua's fair turns),
--       the tenant's live set (Keys.live_of)
-- ARGV: id, score, now, queue limit (0: none), the tenant's weight (0: no
--       fair turn), default output tokens, the tenant's max_queued (0:
--       none), '1' to list the job in the tenant's live set (the tenant has
--       caps), field, value, ...
-- Returns 1 when enqueued, 0 when the id is taken, -1 when the queue is full,
-- -2 when the tenant has max_queued jobs waiting (its batch lines left out).
if redis.call('EXISTS', KEYS[1]) == 1 then
  return 0
end
local limit = tonumber(ARGV[4])
if limit > 0 and redis.call('ZCARD', KEYS[2]) >= limit then
  return -1
end
local job_prefix = string.sub(KEYS[1], 1, #KEYS[1] - #ARGV[1])
local most = tonumber(ARGV[7]) or 0
if most > 0 and KEYS[5]
    and count_live(KEYS[5], job_prefix, {[S.queued] = true, [S.parked] = true}, true)
        >= most then
  return -2
end
redis.call('HSET', KEYS[1], unpack(ARGV, 9))
redis.call('HSET', KEYS[1], 'score', ARGV[2])
redis.call('ZADD', KEYS[2], ARGV[2], ARGV[1])
if KEYS[4] then
  fair_expect(KEYS[4], KEYS[1], tonumber(ARGV[5]), tonumber(ARGV[6]))
  fair_wait(KEYS[1])
end
if ARGV[8] == '1' and KEYS[5] then
  redis.call('SADD', KEYS[5], ARGV[1])
end
redis.call('LPUSH', KEYS[3], ARGV[1])
redis.call('LTRIM', KEYS[3], 0, 63)
return 1
