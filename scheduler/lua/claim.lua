-- Claim the best waiting job for a worker.
-- KEYS: queue zset, worker hash
-- ARGV: job key prefix, worker name, now, claimable states (comma separated)
-- Returns {id, execution token, previous state} or false when nothing waits.
local claimable = {}
for s in string.gmatch(ARGV[4], '[^,]+') do claimable[s] = true end
while true do
  local top = redis.call('ZRANGE', KEYS[1], 0, 0)
  if #top == 0 then
    return false
  end
  local id = top[1]
  redis.call('ZREM', KEYS[1], id)
  local job = ARGV[1] .. id
  local state = redis.call('HGET', job, 'state')
  if state and claimable[state] then
    local exec = redis.call('HINCRBY', job, 'exec', 1)
    redis.call('HSET', job, 'state', 'running', 'worker', ARGV[2], 'resumed_at', ARGV[3])
    redis.call('HSETNX', job, 'started_at', ARGV[3])
    redis.call('HSET', KEYS[2], 'job', id, 'exec', exec)
    return {id, tostring(exec), state}
  end
  -- A stale entry (the job ended meanwhile): drop it and look again.
end
