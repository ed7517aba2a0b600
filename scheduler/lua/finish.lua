-- End a job's execution in a terminal state, with its last events.
-- KEYS: job hash, events stream, worker hash, running zset
-- ARGV: execution token, channel, target state, allowed source states
--       (comma separated), now, ttl, worker name, sequence number of the first
--       payload (0: right after the stream's last event), number of
--       field/value pairs N, N field/value pairs, payloads.
-- Returns -1 when the execution token is stale, -2 when the job's state does
-- not allow the transition, 1 when done.
if redis.call('HGET', KEYS[1], 'exec') ~= ARGV[1] then
  return -1
end
local allowed = {}
for s in string.gmatch(ARGV[4], '[^,]+') do allowed[s] = true end
local state = redis.call('HGET', KEYS[1], 'state')
if not allowed[state] then
  return -2
end
local n = tonumber(ARGV[9])
local have = tonumber(redis.call('HGET', KEYS[1], 'seq'))
local seq = tonumber(ARGV[8])
if seq <= 0 then seq = have + 1 end
for i = 10 + 2 * n, #ARGV do
  if seq > have then
    redis.call('XADD', KEYS[2], seq .. '-0', 'd', ARGV[i])
    redis.call('PUBLISH', ARGV[2], seq .. ' ' .. ARGV[i])
    have = seq
  end
  seq = seq + 1
end
redis.call('HSET', KEYS[1], 'state', ARGV[3], 'finished_at', ARGV[5], 'seq', have)
if n > 0 then
  redis.call('HSET', KEYS[1], unpack(ARGV, 10, 9 + 2 * n))
end
redis.call('HDEL', KEYS[1], 'cancel', 'checkpoint')
redis.call('EXPIRE', KEYS[1], ARGV[6])
redis.call('EXPIRE', KEYS[2], ARGV[6])
if redis.call('HGET', KEYS[3], 'exec') == ARGV[1] then
  redis.call('HDEL', KEYS[3], 'job', 'exec', 'since', 'key', 'preempt')
  redis.call('ZREM', KEYS[4], ARGV[7])
end
return 1
