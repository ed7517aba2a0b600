-- Park a running job: save its generation state, put it back in the queue
-- with its original score (it keeps the age it earned), free the worker.
-- A cancel that arrived while it was parking wins: the job ends cancelled.
-- KEYS: job hash, queue zset, worker hash, running zset, wake list, events stream
-- ARGV: execution token, now, checkpoint (JSON), worker name, channel, ttl,
--       cancel payloads...
-- Returns -1 when the execution token is stale, else 'parked' or 'cancelled'.
if redis.call('HGET', KEYS[1], 'exec') ~= ARGV[1] then
  return -1
end
local id = redis.call('HGET', KEYS[1], 'id')
if redis.call('HGET', KEYS[3], 'exec') == ARGV[1] then
  redis.call('HDEL', KEYS[3], 'job', 'exec', 'since', 'key', 'preempt')
  redis.call('ZREM', KEYS[4], ARGV[4])
end
if redis.call('HEXISTS', KEYS[1], 'cancel') == 1 then
  for i = 7, #ARGV do
    local seq = redis.call('HINCRBY', KEYS[1], 'seq', 1)
    redis.call('XADD', KEYS[6], seq .. '-0', 'd', ARGV[i])
    redis.call('PUBLISH', ARGV[5], seq .. ' ' .. ARGV[i])
  end
  redis.call('HSET', KEYS[1], 'state', 'cancelled', 'finished_at', ARGV[2],
             'finish_reason', 'cancelled')
  redis.call('HDEL', KEYS[1], 'cancel', 'checkpoint')
  redis.call('EXPIRE', KEYS[1], ARGV[6])
  redis.call('EXPIRE', KEYS[6], ARGV[6])
  return 'cancelled'
end
redis.call('HSET', KEYS[1], 'state', 'parked', 'checkpoint', ARGV[3],
           'ckpt_worker', ARGV[4], 'ckpt_exec', ARGV[1], 'parked_at', ARGV[2])
redis.call('HINCRBY', KEYS[1], 'preemptions', 1)
redis.call('ZADD', KEYS[2], redis.call('HGET', KEYS[1], 'score'), id)
redis.call('LPUSH', KEYS[5], id)
redis.call('LTRIM', KEYS[5], 0, 63)
return 'parked'
