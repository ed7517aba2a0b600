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
if state_set(ARGV[5])[state] then
  redis.call('ZREM', KEYS[2], ARGV[1])
  fair_unwait(KEYS[1], ARGV[1])
  emit_after(KEYS[1], KEYS[3], ARGV[2], 7)
  redis.call('HSET', KEYS[1], 'finish_reason', 'cancelled')
  end_job(KEYS[1], KEYS[3], S.cancelled, ARGV[3], ARGV[4])
  return S.cancelled
end
if state_set(ARGV[6])[state] then
  redis.call('HSET', KEYS[1], 'cancel', '1')
  return 'cancelling'
end
return 'ended:' .. state
