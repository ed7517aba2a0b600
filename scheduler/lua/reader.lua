-- Count a job's stream readers; remember when the last one left.
-- KEYS: job hash
-- ARGV: +1 (a reader attaches) or -1 (it leaves), now
-- A job's worker cancels an interactive job whose readers have all been gone
-- for longer than the disconnect grace period.
if redis.call('EXISTS', KEYS[1]) == 0 then
  return false
end
local n = redis.call('HINCRBY', KEYS[1], 'readers', tonumber(ARGV[1]))
if n <= 0 then
  redis.call('HSET', KEYS[1], 'readers', 0, 'detached_at', ARGV[2])
else
  redis.call('HDEL', KEYS[1], 'detached_at')
end
return n
