-- Requeue the jobs of workers whose heartbeat expired, and forget the workers.
-- KEYS: workers zset, queue zset, running zset, wake list
-- ARGV: now, job key prefix, worker key prefix, events key prefix, channel
--       prefix, crash limit, ttl, the reaping worker process's name ('' for none;
--       none of its sequences is reaped), the workers to reap (newline-separated,
--       marked expired by the caller, its own included; '' for every expired
--       one), '1' to count a crash of their jobs ('0': requeue without counting),
--       failure payloads...
-- A job whose worker died while running it goes back to the queue at the
-- place it ran in (lib.lua's requeue_score); it resumes from its last
-- checkpoint (or from the start), and its stream continues without duplicates.
-- A job that has lost its worker `crash limit` times fails instead.
-- Returns a flat list: worker, job id or '', outcome ('requeued', 'failed', ''),
-- the worker's process.
local out = {}
local dead = {}
local only = {}
local targeted = ARGV[9] ~= ''
for name in string.gmatch(ARGV[9], '[^\n]+') do only[name] = true end
for _, w in ipairs(redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', '(' .. ARGV[1])) do
  local proc = redis.call('HGET', ARGV[3] .. w, 'proc') or w
  if targeted then
    if only[w] then table.insert(dead, w) end
  elseif w ~= ARGV[8] and proc ~= ARGV[8] then  -- the reaper is alive, if late (a stall)
    table.insert(dead, w)
  end
end
for _, w in ipairs(dead) do
  local wkey = ARGV[3] .. w
  local id = redis.call('HGET', wkey, 'job')
  local proc = redis.call('HGET', wkey, 'proc') or w
  local exec = redis.call('HGET', wkey, 'exec')
  local outcome = ''
  if id then
    local job = ARGV[2] .. id
    local state = redis.call('HGET', job, 'state')
    if token(job) == exec and (state == S.running or state == S.parking) then
      local crashes = tonumber(redis.call('HGET', job, 'crashes') or '0')
      if ARGV[10] == '1' then crashes = redis.call('HINCRBY', job, 'crashes', 1) end
      if crashes >= tonumber(ARGV[6]) then
        local events = ARGV[4] .. id
        emit_after(job, events, ARGV[5] .. id, 11)
        redis.call('HSET', job, 'error', 'the job lost its worker ' .. crashes .. ' times')
        end_job(job, events, S.failed, ARGV[1], ARGV[7])
        outcome = 'failed'
      else
        move(job, S.queued)
        redis.call('HINCRBY', job, 'exec', 1)  -- fence the dead execution
        redis.call('ZADD', KEYS[2], requeue_score(job, redis.call('HGET', wkey, 'key')), id)
        fair_wait(job)  -- (its tenant's turn: lib.lua)
        redis.call('LPUSH', KEYS[4], id)
        outcome = 'requeued'
      end
    end
  end
  redis.call('DEL', wkey)
  redis.call('ZREM', KEYS[1], w)
  redis.call('ZREM', KEYS[3], w)
  table.insert(out, w)
  table.insert(out, id or '')
  table.insert(out, outcome)
  table.insert(out, proc)
end
return out
