-- Append a running job's events, announce them, and read its control flags.
-- One call per decoding step: the stream write, the live announcement, the
-- token counter, the flag reads and a look at the queue head share one round
-- trip.
-- KEYS: job hash, events stream, worker hash, queue zset, counters hash,
--       inter-token latency histogram hash
-- ARGV: execution token, channel, tokens generated so far, sequence number of
--       the first payload, latency bucket ('' for none), latency (ms), '1' to
--       read the queue head ('0': the caller has it from another job's write of
--       the same step), payload, payload, ...
-- Returns -1 when the execution token is stale (another execution owns the
-- job: nothing is written), {-3, n} when a replayed event n differs from the
-- stored one (nothing from it on is written), {-4, n} when the stream holds
-- only n events, fewer than this write follows (writes lost in a failover:
-- nothing is written), else {flags, queue head score or false, time the
-- job's last reader left or false, events written (not already stored), jobs
-- in the queue or false (not read)}, flags a bit set: 1 cancel requested,
-- 2 preempt (the job is then marked parking).
if token(KEYS[1]) ~= ARGV[1] then
  return -1
end
local written, diverged = emit_numbered(KEYS[1], KEYS[2], ARGV[2], tonumber(ARGV[4]), 8)
if diverged > 0 then
  return {-3, diverged}
elseif diverged < 0 then
  return {-4, tonumber(redis.call('HGET', KEYS[1], 'seq'))}
end
local new_tokens = tonumber(ARGV[3]) - tonumber(redis.call('HGET', KEYS[1], 'tokens') or '0')
if new_tokens > 0 then
  redis.call('HINCRBY', KEYS[5], 'tokens', new_tokens)
end
redis.call('HSET', KEYS[1], 'tokens', ARGV[3])
-- A write that gathers several fast steps observes each of its events at the
-- mean gap (ARGV[6] is per event); a write made again (a retry) observes only
-- the events it adds.
if ARGV[5] ~= '' and written > 0 then
  observe(KEYS[6], ARGV[5], written, tonumber(ARGV[6]))
end
local flags = 0
if redis.call('HEXISTS', KEYS[1], 'cancel') == 1 then
  flags = flags + 1
elseif redis.call('HEXISTS', KEYS[3], 'preempt') == 1 then
  flags = flags + 2
  move(KEYS[1], S.parking)
end
local head, queued = {}, false
if ARGV[7] == '1' then
  head = redis.call('ZRANGE', KEYS[4], 0, 0, 'WITHSCORES')
  queued = redis.call('ZCARD', KEYS[4])
end
return {flags, head[2] or false, redis.call('HGET', KEYS[1], 'detached_at'), written, queued}
