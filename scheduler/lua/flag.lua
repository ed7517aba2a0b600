-- Ask a worker to park its running job, if it still runs the same execution.
-- KEYS: worker hash
-- ARGV: job id, execution token
-- Returns 1 when the flag was set, 0 when the worker moved on.
if redis.call('HGET', KEYS[1], 'job') == ARGV[1] and redis.call('HGET', KEYS[1], 'exec') == ARGV[2] then
  redis.call('HSET', KEYS[1], 'preempt', '1')
  return 1
end
return 0
