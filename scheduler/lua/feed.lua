-- Keep up to `window` lines of a batch in the queue: forget the batch's jobs
-- that have ended, then enqueue pending lines until the window is full. Any
-- process may call it at any time (it is idempotent), so a batch moves on
-- whoever ended its last job.
-- KEYS: batch hash, pending list, live set, queue zset, wake list
-- ARGV: now, job key prefix, window, score for now, live states (csv), pending prefix
if redis.call('HGET', KEYS[1], 'status') ~= 'in_progress' then
  return 0
end
local live_states = state_set(ARGV[5])
local n = 0
for _, id in ipairs(redis.call('SMEMBERS', KEYS[3])) do
  local st = redis.call('HGET', ARGV[2] .. id, 'state')
  if st and live_states[st] then
    n = n + 1
  else
    redis.call('SREM', KEYS[3], id)
  end
end
local fed = 0
local window = tonumber(ARGV[3])
while n < window do
  local id = redis.call('LPOP', KEYS[2])
  if not id then break end
  local job = ARGV[2] .. id
  redis.call('RENAME', ARGV[6] .. id, job)
  redis.call('HSET', job, 'created_at', ARGV[1], 'enqueued_at', ARGV[1], 'score', ARGV[4])
  redis.call('ZADD', KEYS[4], ARGV[4], id)
  redis.call('LPUSH', KEYS[5], id)
  redis.call('LTRIM', KEYS[5], 0, 63)
  redis.call('SADD', KEYS[3], id)
  n = n + 1
  fed = fed + 1
end
return fed
