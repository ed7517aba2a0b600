-- Cancel a job in any state.
-- KEYS: job hash, queue zset, events stream
-- ARGV: id, channel, now, ttl, states cancelled at once (comma separated),
--       states asked to stop at their next step (comma separated), payloads...
-- Returns false for an unknown job, 'cancelled' when it ended here,
-- 'cancelling' when its worker will stop it, else 'ended:<its terminal state>'.
local state = redis.call('HGET', KEYS[1], 'state')
if not state then
  return false
end
local now_states, flag_states = {}, {}
for s in string.gmatch(ARGV[5], '[^,]+') do now_states[s] = true end
for s in string.gmatch(ARGV[6], '[^,]+') do flag_states[s] = true end
if now_states[state] then
  redis.call('ZREM', KEYS[2], ARGV[1])
  for i = 7, #ARGV do
    local seq = redis.call('HINCRBY', KEYS[1], 'seq', 1)
    redis.call('XADD', KEYS[3], seq .. '-0', 'd', ARGV[i])
    redis.call('PUBLISH', ARGV[2], seq .. ' ' .. ARGV[i])
  end
  redis.call('HSET', KEYS[1], 'state', 'cancelled', 'finished_at', ARGV[3],
             'finish_reason', 'cancelled')
  redis.call('HDEL', KEYS[1], 'checkpoint')
  redis.call('EXPIRE', KEYS[1], ARGV[4])
  redis.call('EXPIRE', KEYS[3], ARGV[4])
  return 'cancelled'
end
if flag_states[state] then
  redis.call('HSET', KEYS[1], 'cancel', '1')
  return 'cancelling'
end
return 'ended:' .. state
