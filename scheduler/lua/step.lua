-- Append a running job's events, announce them, and read its control flags.
-- One call per decoding step: the stream write, the live announcement, the
-- token counter and the flag reads share one round trip.
-- KEYS: job hash, events stream, worker hash
-- ARGV: execution token, channel, tokens generated so far, payload, payload, ...
-- Returns -1 when the execution token is stale (another execution owns the
-- job: nothing is written), else a bit set: 1 cancel requested, 2 preempt.
if redis.call('HGET', KEYS[1], 'exec') ~= ARGV[1] then
  return -1
end
for i = 4, #ARGV do
  local seq = redis.call('HINCRBY', KEYS[1], 'seq', 1)
  redis.call('XADD', KEYS[2], seq .. '-0', 'd', ARGV[i])
  redis.call('PUBLISH', ARGV[2], seq .. ' ' .. ARGV[i])
end
redis.call('HSET', KEYS[1], 'tokens', ARGV[3])
local flags = 0
if redis.call('HEXISTS', KEYS[1], 'cancel') == 1 then flags = flags + 1 end
if redis.call('HEXISTS', KEYS[3], 'preempt') == 1 then flags = flags + 2 end
return flags
