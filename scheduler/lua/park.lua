-- Park a running job: save its generation state, put it back in the queue
-- at the place it ran in (it keeps the age it earned: lib.lua's
-- requeue_score), free the worker.
-- A cancel that arrived while it was parking wins: the job ends cancelled.
-- A park counts, for the job's tenant, one park and the tokens it had generated.
-- KEYS: job hash, queue zset, worker hash, running zset, wake list, events stream,
--       counters hash, this hour's usage hash (web/usage.py)
-- ARGV: execution token, now, checkpoint (JSON), worker name, channel, ttl,
--       the checkpoint's holder (the worker's process; '' when it keeps no
--       KV: the job resumes by replay anywhere), the usage hash's ttl, cancel
--       payloads...
-- Returns -1 when the execution token is stale, {-4, n} when the checkpoint
-- counts more events than the stream's n (writes lost in a failover: nothing
-- is written; the job is replayed), else 'parked' or 'cancelled'.
if token(KEYS[1]) ~= ARGV[1] then
  return -1
end
local have = tonumber(redis.call('HGET', KEYS[1], 'seq') or '0')
local ok, saved = pcall(cjson.decode, ARGV[3])
if ok and type(saved) == 'table' and tonumber(saved['events'] or 0) > have then
  return {-4, have}
end
local place = nil  -- (the place it ran in: lib.lua's requeue_score)
if redis.call('HGET', KEYS[3], 'exec') == ARGV[1] then
  place = redis.call('HGET', KEYS[3], 'key')
end
release_worker(KEYS[3], KEYS[4], ARGV[4], ARGV[1])
if redis.call('HEXISTS', KEYS[1], 'cancel') == 1 then
  emit_after(KEYS[1], KEYS[6], ARGV[5], 9)
  redis.call('HSET', KEYS[1], 'finish_reason', 'cancelled')
  end_job(KEYS[1], KEYS[6], S.cancelled, ARGV[2], ARGV[6])
  return S.cancelled
end
local id = redis.call('HGET', KEYS[1], 'id')
if redis.call('HGET', KEYS[1], 'state') ~= S.parked then  -- (not a repeat of this park)
  -- How long it has run: what a replay elsewhere (token by token) would cost.
  local resumed = tonumber(redis.call('HGET', KEYS[1], 'resumed_at') or ARGV[2])
  redis.call('HINCRBYFLOAT', KEYS[1], 'run_seconds', math.max(0, tonumber(ARGV[2]) - resumed))
  if KEYS[8] then  -- the tenant's usage: a park, and the tokens generated since the last
    local ttl = tonumber(ARGV[8])
    local tokens = tonumber(redis.call('HGET', KEYS[1], 'tokens') or '0')
    local before = tonumber(redis.call('HGET', KEYS[1], 'parked_counted') or '0')
    count_usage(KEYS[8], KEYS[7], KEYS[1], 'parks', 1, ttl)
    count_usage(KEYS[8], KEYS[7], KEYS[1], 'parked', tokens - before, ttl)
    redis.call('HSET', KEYS[1], 'parked_counted', tokens)
  end
end
move(KEYS[1], S.parking)  -- (a no-op when the step already marked it)
move(KEYS[1], S.parked)
redis.call('HSET', KEYS[1], 'checkpoint', ARGV[3], 'ckpt_exec', ARGV[1], 'parked_at', ARGV[2])
if ARGV[7] ~= '' then
  redis.call('HSET', KEYS[1], 'ckpt_worker', ARGV[7])
else
  redis.call('HDEL', KEYS[1], 'ckpt_worker')  -- no KV kept: nobody to wait for
end
redis.call('HINCRBY', KEYS[1], 'preemptions', 1)
redis.call('ZADD', KEYS[2], requeue_score(KEYS[1], place), id)
fair_wait(KEYS[1])  -- (its tenant's turn: lib.lua)
redis.call('LPUSH', KEYS[5], id)
redis.call('LTRIM', KEYS[5], 0, 63)
return S.parked
