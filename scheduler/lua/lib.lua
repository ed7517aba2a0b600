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
-- start-time fair queueing. Each level has a virtual time (field `v|<level>`
-- of the fair hash, in tokens per unit of weight: the virtual start of the
-- last job claimed there, set by claim.lua), each tenant a clock per level
-- (`c|<level>|<tenant>`: '<virtual finish of its last job> <that job's key
-- time> <its id>'). A job starts at the later of the level's virtual time
-- and its tenant's clock (a tenant whose jobs ran while others waited is
-- behind by what they took; one whose last job there was cancelled before it
-- ran takes that job's start), and moves the clock on by what it is expected to take (its
-- prompt and an output as fair_output's averages expect, at most its
-- max_tokens) over the tenant's weight. It waits as if it
-- had arrived as long after now as the level's virtual time takes to reach
-- its start, at the speed claims moved it lately (field `g|<level>`, measured
-- by fair_claimed; `default_speed` before), at most `cap` seconds (half a
-- level's worth) and never before now, and never before its tenant's last
-- job there while that one waits or was cancelled (a tenant's jobs keep their
-- order; one claimed was the last of them to wait). Weight 0: no fair turn (it
-- waits from now). Returns the key time (the score is a job of its level
-- arriving then).
local function fair_start(fair, job, now, weight, default_out, default_speed, cap)
  if weight <= 0 then return now end
  local owner = redis.call('HGET', job, 'owner') or ''
  local level = redis.call('HGET', job, 'priority') or '0'
  local field = 'c|' .. level .. '|' .. owner
  local got = redis.call('HMGET', fair, field, 's|' .. owner, 'g|' .. level, 'f|' .. owner,
                         'v|' .. level)
  local v = tonumber(got[5])
  if not v then
    v = 0  -- (the level's first turn: any origin will do, only differences count)
    redis.call('HSET', fair, 'v|' .. level, '0')
  end
  local start, floor = v, nil
  if got[1] then
    local f, key, last = string.match(got[1], '^(%S+) (%S+) (.*)$')
    if f and last then
      start = math.max(v, tonumber(f) or v)
      local was = redis.call('HMGET', string.match(job, '^(.-:job:)') .. last, 'state', 'fair_v',
                             'started_at')
      if was[1] == S.queued or was[1] == S.parked then
        floor = tonumber(key)
      elseif was[1] == S.cancelled then
        -- (its earlier jobs may still wait: not before them; one cancelled
        -- before it ever ran hands its turn on, one that ran is charged)
        if not was[3] then start = math.max(v, tonumber(was[2]) or v) end
        floor = tonumber(key)
      end
    end
  end
  local out = tonumber(got[2]) or default_out
  local speed = tonumber(got[3]) or default_speed
  if speed <= 0 then speed = default_speed end
  local most = tonumber(redis.call('HGET', job, 'max_out') or '') or 0
  if most > 0 then
    -- The larger of its usual output and its usual share of max_tokens, at
    -- most max_tokens: a tenant whose jobs fill their max_tokens is expected to
    -- fill a larger one too.
    out = math.min(math.max(out, (tonumber(got[4]) or 1) * most), most)
  end
  local prompt = tonumber(redis.call('HGET', job, 'prompt_n') or '0') or 0
  local tokens = math.min((prompt + math.max(1, out)) / weight, 1e12)  -- (finite)
  local at = now + math.min(math.max(start - v, 0) / speed, cap)
  if floor and at <= floor then at = floor + 0.001 end  -- (its own order kept)
  redis.call('HSET', fair, field, string.format('%.17g', start + tokens) .. ' '
             .. string.format('%.17g', at) .. ' ' .. redis.call('HGET', job, 'id'))
  redis.call('HSET', job, 'fair_start', string.format('%.17g', at),
             'fair_v', string.format('%.17g', start), 'fair_tokens', string.format('%.17g', tokens))
  return at
end

-- A claimed job moves its level's virtual time to its own virtual start
-- (fair_start): a turn taken there starts no earlier. The speed virtual time
-- moves at (field `g|<level>`) is how far it moved over how long, each an
-- average over about the last `claims` claims at the level that followed a
-- claim there which left other jobs waiting (`busy`: no idle spell counts),
-- starting from `guess` per second (field `g_at|<level>`: '<the last claim's
-- time> <moved> <seconds> <1 if it was busy>'). A parked job claimed again
-- does not move it. A job taken out of turn (`overdue`, or its start farther
-- ahead than a key can show: `cap` seconds at the speed so far) moves it only
-- as far as the speed carries it since the last claim, and is not counted in
-- the speed: its turn is a jump (a backlog past half a level), which would
-- wipe out every other tenant's place and, as speed, flatten every later key.
local function fair_claimed(fair, job, now, busy, claims, min_speed, guess, overdue, cap)
  local got = redis.call('HMGET', job, 'fair_v', 'priority')
  local fv = tonumber(got[1])
  if not fv then return end
  local level = got[2] or '0'
  local r = redis.call('HMGET', fair, 'v|' .. level, 'g_at|' .. level, 'g|' .. level)
  local cur = tonumber(r[1])
  local speed = tonumber(r[3]) or guess
  local at, dv, dt, was_busy = string.match(r[2] or '', '^(%S+) (%S+) (%S+) (%S+)$')
  at, dv, dt = tonumber(at), tonumber(dv), tonumber(dt)
  local out_of_turn = overdue or (cur ~= nil and fv - cur > speed * cap)
  local moved = 0
  if not cur or fv > cur then
    local to = fv
    if cur and out_of_turn then
      to = math.min(fv, cur + speed * math.max(0, now - (at or now)))
    end
    if not cur or to > cur then
      redis.call('HSET', fair, 'v|' .. level, string.format('%.17g', to))
      if cur then moved = to - cur end
    end
  end
  if not (dv and dt and dt > 0) then
    dv, dt = guess, 1  -- (a first guess that the first claims only move a little)
  end
  if at and was_busy == '1' and not out_of_turn then
    local a = 1 / claims
    dv, dt = dv + a * (moved - dv), dt + a * (math.max(0, now - at) - dt)
    if dt > 0 then
      redis.call('HSET', fair, 'g|' .. level,
                 string.format('%.17g', math.max(dv / dt, min_speed)))
    end
  end
  redis.call('HSET', fair, 'g_at|' .. level, string.format('%.17g', now) .. ' '
             .. string.format('%.17g', dv) .. ' ' .. string.format('%.17g', dt) .. ' '
             .. (busy and '1' or '0'))
end

-- The score of a job of the level whose score now is `score_now` (a string)
-- arriving at `start` instead, as a string (of full precision: Lua's own
-- number-to-string conversion keeps 14 digits, a tenth of a millisecond).
local function fair_score(score_now, aging, start, now)
  if start == now then return score_now end
  return string.format('%.17g', tonumber(score_now) + tonumber(aging) * (start - now))
end

-- A finished job's output tokens move its tenant's usual output and its
-- usual share of max_tokens (averages that weigh the last 5 jobs or so), what
-- fair_start expects of the next.
local function fair_output(fair, job, completion)
  if not fair or not completion then return end
  local owner = redis.call('HGET', job, 'owner')
  if not owner or owner == '' or not redis.call('HGET', job, 'fair_v') then
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
