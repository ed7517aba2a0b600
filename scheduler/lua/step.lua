-- Append a running job's events, announce them, and read its control flags.
-- One call per decoding step: the stream write, the live announcement, the
-- token counter, the flag reads and a look at the queue head share one round
-- trip.
-- KEYS: job hash, events stream, worker hash, queue zset
-- ARGV: execution token, channel, tokens generated so far, sequence number of
--       the first payload, payload, payload, ...
-- Returns -1 when the execution token is stale (another execution owns the
-- job: nothing is written), else {flags, queue head score or false}, flags a
-- bit set: 1 cancel requested, 2 preempt (the job is then marked parking).
if redis.call('HGET', KEYS[1], 'exec') ~= ARGV[1] then
  return -1
end
emit_numbered(KEYS[1], KEYS[2], ARGV[2], tonumber(ARGV[4]), 5)
redis.call('HSET', KEYS[1], 'tokens', ARGV[3])
local flags = 0
if redis.call('HEXISTS', KEYS[1], 'cancel') == 1 then
  flags = flags + 1
elseif redis.call('HEXISTS', KEYS[3], 'preempt') == 1 then
  flags = flags + 2
  redis.call('HSET', KEYS[1], 'state', 'parking')
end
local head = redis.call('ZRANGE', KEYS[4], 0, 0, 'WITHSCORES')
return {flags, head[2] or false}
