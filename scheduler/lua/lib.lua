-- Helpers shared by parkq's scripts: prepended to each script when it is loaded.

-- A job's execution token: its execution counter and the nonce its claimer
-- gave. A claim lost in a failover rolls the counter back, and the next claim
-- counts to the same number again: the nonce still tells the two apart.
local function token(job)
  return (redis.call('HGET', job, 'exec') or '0') .. '.' .. (redis.call('HGET', job, 'nonce') or '')
end

-- The set of states in a comma-separated list.
local function state_set(csv)
  local set = {}
  for s in string.gmatch(csv, '[^,]+') do set[s] = true end
  return set
end

-- Append one event to a job's stream and announce it live.
local function emit(events, channel, seq, payload)
  redis.call('XADD', events, seq .. '-0', 'd', payload)
  redis.call('PUBLISH', channel, seq .. ' ' .. payload)
end

-- Append ARGV[from..] right after the stream's last event.
local function emit_after(job, events, channel, from)
  for i = from, #ARGV do
    emit(events, channel, redis.call('HINCRBY', job, 'seq', 1), ARGV[i])
  end
end

-- Write ARGV[from..] numbered from `first` (0: right after the last event),
-- skipping the ones the stream already has: a generation replayed after a
-- crash re-creates events its client already received. Each one skipped is
-- compared with the stored one: a replay that computed another event (another
-- kernel path, thread count or device rounds otherwise) is never spliced into
-- the stream; nothing from that event on is written, and its number is
-- returned as the second value (0: none differed). An event numbered past the
-- stream's next one means events the writer wrote are gone (a failover to a
-- replica that had not received them): nothing is written, and the second
-- value is -1 (the job is replayed to write them again).
local function emit_numbered(job, events, channel, first, from)
  local have = tonumber(redis.call('HGET', job, 'seq'))
  local seq = first
  local written = 0
  if seq <= 0 then seq = have + 1 end
  if seq > have + 1 then  -- (a write of no events too: its number is the next one's)
    return 0, -1
  end
  for i = from, #ARGV do
    if seq > have then
      emit(events, channel, seq, ARGV[i])
      have = seq
      written = written + 1
    else
      local stored = redis.call('XRANGE', events, seq .. '-0', seq .. '-0')
      if stored[1] and stored[1][2][2] ~= ARGV[i] then
        redis.call('HSET', job, 'seq', have)
        return written, seq
      end
    end
    seq = seq + 1
  end
  redis.call('HSET', job, 'seq', have)
  return written, 0
end

-- Add `n` observations of `value` ms each to a latency histogram.
local function observe(hist, bucket, n, value)
  redis.call('HINCRBY', hist, bucket, n)
  redis.call('HINCRBY', hist, 'count', n)
  redis.call('HINCRBYFLOAT', hist, 'sum', value * n)
end

-- Put a job in a terminal state and let it and its stream expire.
-- A job of a batch keeps its result until the batch's output file is written
-- (BatchStore.release_results then gives it the result TTL): a batch may take
-- longer than the TTL.
-- A job not of a batch is also listed for the janitor of `parkq web`
-- (Keys.ended, beside the job's key), which keeps its result and lets its
-- per-token events go after the replay window.
local function end_job(job, events, state, now, ttl)
  redis.call('HSET', job, 'state', state, 'finished_at', now)
  redis.call('HDEL', job, 'cancel', 'checkpoint')
  if redis.call('HEXISTS', job, 'batch') == 0 then
    redis.call('EXPIRE', job, ttl)
    redis.call('EXPIRE', events, ttl)
    local base = string.match(job, '^(.-):job:')
    local id = redis.call('HGET', job, 'id')
    if base and id then
      redis.call('ZADD', base .. ':ended', now, id)
    end
  end
end

-- Free a worker's slot if it still runs execution `exec`.
local function release_worker(worker, running, name, exec)
  if redis.call('HGET', worker, 'exec') == exec then
    redis.call('HDEL', worker, 'job', 'exec', 'since', 'key', 'preempt', 'pinned')
    redis.call('ZREM', running, name)
  end
end


-- A tenant's token bucket (web/limits.py): a minute's worth at `rate_min` tokens
-- per minute, refilled continuously. Takes `cost` if the bucket holds it (or is
-- full: a request larger than a minute's worth takes it below zero) and
-- returns 0; else takes nothing and returns the seconds until it would fit.
-- A negative cost gives tokens back (a request that was not queued after all).
-- The bucket's clock never goes back: a caller whose clock is behind refills nothing.
local function take_tokens(key, now, rate_min, cost)
  local cap, rate = rate_min, rate_min / 60.0
  local got = redis.call('HMGET', key, 'tokens', 'at')
  local tokens = tonumber(got[1]) or cap
  local at = tonumber(got[2]) or now
  tokens = math.min(cap, tokens + math.max(0, now - at) * rate)
  local need = math.min(cost, cap)
  local wait = 0
  if cost < 0 then
    tokens = math.min(cap, tokens - cost)
  elseif tokens >= need then
    tokens = tokens - cost
  else
    wait = (need - tokens) / rate
  end
  redis.call('HSET', key, 'tokens', tostring(tokens), 'at', tostring(math.max(at, now)))
  redis.call('EXPIRE', key, math.ceil(math.max(0, cap - tokens) / rate) + 60)
  return wait
end

-- Count a tenant's usage (web/usage.py): `what` += n in its hour's hash (kept
-- `ttl` seconds) and in the all-time counters.
local function count_usage(hour, counters, job, what, n, ttl)
  if n == nil or n <= 0 then return end
  local who = redis.call('HGET', job, 'owner') or ''
  redis.call('HINCRBY', hour, who .. '|' .. what, n)
  redis.call('EXPIRE', hour, ttl)
  redis.call('HINCRBY', counters, 'usage|' .. who .. '|' .. what, n)
end

-- Fair turns between tenants at one priority level (scheduler/fairness.py):
-- start-time fair queueing over each tenant's own queue. The fair hash
-- (`turns`, Keys.fair) holds each level's virtual time (`v|<level>`, in
-- tokens per unit of weight: the turn of the last job claimed there) and each
-- tenant's clock there (`c|<level>|<tenant>`: the turn its last claimed job
-- ended at). A tenant's jobs waiting at a level are listed in its own queue
-- (`<base>:tq:<level>:<tenant>`, by their scores: a parked one keeps its
-- place), and a tenant with jobs there in the level's turns
-- (`<base>:heads:<level>`, tenant -> its turn): the later of the level's
-- virtual time and its clock, set when it comes to wait and again after each
-- claim of its. The claim takes the job of the earliest turn that fits
-- (claim.lua). A job's score is its own (scheduler/policy.py): turns decide
-- only among the jobs of a level, in the place of its first.

-- The keys of a job's fair turn: its base, level and tenant, or nil when it
-- takes none (no `fair_tokens`).
local function fair_of(job)
  local base = string.match(job, '^(.-):job:')
  local f = redis.call('HMGET', job, 'fair_tokens', 'priority', 'owner')
  if not base or not f[1] then return nil end
  return base, f[2] or '0', f[3] or ''
end

-- A tenant's turn at a level now: the later of the level's virtual time and its clock.
local function fair_turn(base, level, owner)
  local got = redis.call('HMGET', base .. ':turns', 'v|' .. level, 'c|' .. level .. '|' .. owner)
  local v = tonumber(got[1]) or 0
  return math.max(v, tonumber(got[2]) or v), v
end

-- What a job's turn is expected to take, over its tenant's weight (`fair_tokens`):
-- its prompt and the larger of its tenant's usual output and its tenant's usual
-- share of max_tokens times its own, at most its max_tokens (fair_output keeps
-- the averages; `default_out` before any). Weight 0: no fair turn.
local function fair_expect(fair, job, weight, default_out)
  if weight <= 0 then return end
  local owner = redis.call('HGET', job, 'owner') or ''
  local got = redis.call('HMGET', fair, 's|' .. owner, 'f|' .. owner)
  local out = tonumber(got[1]) or default_out
  local most = tonumber(redis.call('HGET', job, 'max_out') or '') or 0
  if most > 0 then
    out = math.min(math.max(out, (tonumber(got[2]) or 1) * most), most)
  end
  local prompt = tonumber(redis.call('HGET', job, 'prompt_n') or '0') or 0
  local tokens = math.min((prompt + math.max(1, out)) / weight, 1e12)  -- (finite)
  redis.call('HSET', job, 'fair_tokens', string.format('%.17g', tokens), 'fair_w',
             string.format('%.17g', weight))
end

-- A job comes to wait (queued, parked or requeued): listed in its tenant's
-- queue at its level by its score, and the tenant in the level's turns if it
-- was not (at its turn now).
local function fair_wait(job)
  local base, level, owner = fair_of(job)
  if not base then return end
  local f = redis.call('HMGET', job, 'score', 'id')
  redis.call('ZADD', base .. ':tq:' .. level .. ':' .. owner, f[1], f[2])
  local heads = base .. ':heads:' .. level
  if not redis.call('ZSCORE', heads, owner) then
    redis.call('HSETNX', base .. ':turns', 'v|' .. level, '0')  -- (the janitor reads the levels)
    redis.call('ZADD', heads, string.format('%.17g', fair_turn(base, level, owner)), owner)
  end
end

-- A job stops waiting (claimed or cancelled): off its tenant's queue, and the
-- tenant off the level's turns when nothing of it waits there.
local function fair_unlist(base, level, owner, id)
  local tq = base .. ':tq:' .. level .. ':' .. owner
  redis.call('ZREM', tq, id)
  if redis.call('ZCARD', tq) == 0 then
    redis.call('ZREM', base .. ':heads:' .. level, owner)
  end
end

local function fair_unwait(job, id)
  local base, level, owner = fair_of(job)
  if base then fair_unlist(base, level, owner, id) end
end

-- A claimed job took its tenant's turn `turn` (nil: the tenant's turn now).
-- On the job's first claim (`fair_c` marks it), the level's virtual time
-- moves on to the turn and the tenant's clock to the turn plus what the job
-- is expected to take. A job claimed again (parked, or requeued when its
-- worker died) was charged: it moves neither, but puts the tenant's clock a
-- token past the turn, so that a tenant waiting at the turn goes next (a
-- backlog's parked jobs do not win every equal turn). The tenant's turn is
-- set again if it has more waiting.
local function fair_claimed(job, id, turn)
  local base, level, owner = fair_of(job)
  if not base then return end
  local now_turn, v = fair_turn(base, level, owner)
  turn = turn or now_turn
  local fair = base .. ':turns'
  local clock = 'c|' .. level .. '|' .. owner
  if redis.call('HSETNX', job, 'fair_c', '1') == 1 then
    if turn > v then
      v = turn
      redis.call('HSET', fair, 'v|' .. level, string.format('%.17g', v))
    end
    redis.call('HSET', job, 'fair_v', string.format('%.17g', turn))
    local tokens = tonumber(redis.call('HGET', job, 'fair_tokens')) or 0
    redis.call('HSET', fair, clock, string.format('%.17g', turn + tokens))
  else
    local weight = tonumber(redis.call('HGET', job, 'fair_w') or '') or 1
    local c = tonumber(redis.call('HGET', fair, clock) or '') or v
    redis.call('HSET', fair, clock, string.format('%.17g', math.max(c, turn + 1 / weight)))
  end
  fair_unlist(base, level, owner, id)
  local heads = base .. ':heads:' .. level
  if redis.call('ZSCORE', heads, owner) then
    redis.call('ZADD', heads, string.format('%.17g', fair_turn(base, level, owner)), owner)
  end
end

-- The first job still waiting in a tenant's queue, dropping at most `budget`
-- entries of jobs that no longer wait (their state not in `waiting`, or off
-- the queue `queue`); nil when none is found, and whether the queue is empty.
local function fair_first(tq, queue, job_prefix, waiting, budget)
  for _ = 0, budget do
    local top = redis.call('ZRANGE', tq, 0, 0)
    if #top == 0 then return nil, true end
    local id = top[1]
    if waiting[redis.call('HGET', job_prefix .. id, 'state') or '']
        and redis.call('ZSCORE', queue, id) then
      return id, false
    end
    redis.call('ZREM', tq, id)
  end
  return nil, false
end

-- A finished job's output tokens move its tenant's usual output and its
-- usual share of max_tokens (averages that weigh the last 5 jobs or so), what
-- fair_start expects of the next.
local function fair_output(fair, job, completion)
  if not fair or not completion then return end
  local owner = redis.call('HGET', job, 'owner')
  if not owner or owner == '' or not redis.call('HGET', job, 'fair_tokens') then
    return  -- (no tenant, or no fair turn: nothing expects it)
  end
  local most = tonumber(redis.call('HGET', job, 'max_out') or '') or 0
  local values = {{'s|' .. owner, completion}}
  if most > 0 then values[2] = {'f|' .. owner, math.min(1, completion / most)} end
  for _, v in ipairs(values) do
    local old = tonumber(redis.call('HGET', fair, v[1]) or '')
    local new = v[2]
    if old then new = 0.8 * old + 0.2 * v[2] end
    redis.call('HSET', fair, v[1], string.format('%.17g', new))
  end
end

-- The score a job that ran goes back to the queue at: the place it ran in
-- (`key`, its worker's key when the worker still ran this execution: its own
-- score, or that of the job whose place a fair turn gave it, claim.lua), else
-- its own. A job parked or requeued keeps the age its place earned.
local function requeue_score(job, key)
  local place = tonumber(key or '')
  if place then return string.format('%.17g', -place) end
  return redis.call('HGET', job, 'score')
end

-- A tenant's caps (scheduler/tenancy.py: max_running, max_queued) count the
-- jobs in its live set (Keys.live_of): how many of them are in one of
-- `states` (a set), batch lines left out where `requests_only`, dropping the
-- ids of jobs that have ended or are gone.
local function count_live(set, job_prefix, states, requests_only)
  local n = 0
  for _, id in ipairs(redis.call('SMEMBERS', set)) do
    local got = redis.call('HMGET', job_prefix .. id, 'state', 'batch')
    local st = got[1]
    if not st or st == S.finished or st == S.failed or st == S.cancelled then
      redis.call('SREM', set, id)
    elseif states[st] and not (requests_only and got[2]) then
      n = n + 1
    end
  end
  return n
end
