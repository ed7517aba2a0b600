-- Keep up to `window` lines of a batch in the queue: forget the batch's jobs
-- that have ended, then enqueue pending lines until the window is full. Any
-- process may call it at any time (it is idempotent), so a batch moves on
-- whoever ended its last job.
-- A line whose tenant's token bucket cannot take its cost (its prompt and most
-- output tokens) waits at the head of the batch, and the lines behind it too.
-- Such a batch is noted in the waiting set, scored by when its line will fit
-- (the janitor feeds it then: no line of it may be running to do so).
-- Each line queued takes its tenant's fair turns (lib.lua).
-- A line of a tenant with caps is listed in the tenant's live set.
-- KEYS: batch hash, pending list, live set, queue zset, wake list, the tenant's
--       token bucket, the waiting set, the fair hash, the tenant's live set
-- ARGV: now, job key prefix, window, score for now, live states (csv), pending
--       prefix, the tenant's tokens per minute (0: no limit), the tenant's
--       weight (0: no fair turn), default output tokens, '1' when the tenant
--       has caps
if redis.call('HGET', KEYS[1], 'status') ~= 'in_progress'
    or redis.call('HEXISTS', KEYS[1], 'expired_at') == 1 then  -- (past its window)
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
local rate_min = tonumber(ARGV[7] or '0') or 0
while n < window do
  local id = redis.call('LINDEX', KEYS[2], 0)
  if not id then break end
  if rate_min > 0 then
    local cost = tonumber(redis.call('HGET', ARGV[6] .. id, 'cost') or '0') or 0
    local wait = take_tokens(KEYS[6], tonumber(ARGV[1]), rate_min, cost)
    if wait > 0 then
      redis.call('ZADD', KEYS[7], tonumber(ARGV[1]) + wait, redis.call('HGET', KEYS[1], 'id'))
      break
    end
  end
  redis.call('LPOP', KEYS[2])
  local job = ARGV[2] .. id
  redis.call('RENAME', ARGV[6] .. id, job)
  redis.call('HSET', job, 'created_at', ARGV[1], 'enqueued_at', ARGV[1], 'score', ARGV[4])
  redis.call('ZADD', KEYS[4], ARGV[4], id)
  if KEYS[8] then
    fair_expect(KEYS[8], job, tonumber(ARGV[8]) or 0, tonumber(ARGV[9]) or 0)
    fair_wait(job)
  end
  redis.call('LPUSH', KEYS[5], id)
  redis.call('LTRIM', KEYS[5], 0, 63)
  redis.call('SADD', KEYS[3], id)
  if ARGV[10] == '1' and KEYS[9] then redis.call('SADD', KEYS[9], id) end
  n = n + 1
  fed = fed + 1
end
return fed
