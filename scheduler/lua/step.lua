-- Append a running job's events, announce them, and read its control flags.
-- One call per decoding step: the stream write, the live announcement, the
-- token counter, the flag reads and a look at the queue head share one round
-- trip.
-- KEYS: job hash, events stream, worker hash, queue zset
-- ARGV: execution token, channel, tokens generated so far, sequence number of
--       the first payload, payload, payload, ...
-- Payloads whose sequence number is already in the stream are skipped (a
-- generation replayed after a crash re-creates events its client already has).
-- Returns -1 when the execution token is stale (another execution owns the
-- job: nothing is written), else {flags, queue head score or false}, flags a
-- bit set: 1 cancel requested, 2 preempt (the job is then marked parking).
if redis.call('HGET', KEYS[1], 'exec') ~= ARGV[1] then
  return -1
end
local have = tonumber(redis.call('HGET', KEYS[1], 'seq'))
local seq = tonumber(ARGV[4])
for i = 5, #ARGV do
  if seq > have then
    redis.call('XADD', KEYS[2], seq .. '-0', 'd', ARGV[i])
    redis.call('PUBLISH', ARGV[2], seq .. ' ' .. ARGV[i])
    have = seq
  end
  seq = seq + 1
end
redis.call('HSET', KEYS[1], 'seq', have, 'tokens', ARGV[3])
local flags = 0
if redis.call('HEXISTS', KEYS[1], 'cancel') == 1 then
  flags = flags + 1
elseif redis.call('HEXISTS', KEYS[3], 'preempt') == 1 then
  flags = flags + 2
  redis.call('HSET', KEYS[1], 'state', 'parking')
end
local head = redis.call('ZRANGE', KEYS[4], 0, 0, 'WITHSCORES')
return {flags, head[2] or false}
