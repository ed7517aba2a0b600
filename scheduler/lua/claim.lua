-- Claim the best waiting job for a worker.
-- KEYS: queue zset, worker hash, running zset, workers zset
-- ARGV: job key prefix, worker name, now, claimable states (comma separated),
--       affinity seconds, how many queue entries to read at a time, '1' if the
--       worker never parks (then no one asks it to), the digest of the
--       worker's model ('' for any), the name of the worker's process (its
--       sequences share the process's checkpoints), the worker's device, the
--       most queue entries to look at in all, a nonce for the execution token
--       (see lib.lua's token), how many tenants' turns a claim looks at
-- The queue is read in pages until a job fits: jobs this worker may not take
-- (another model's, parked jobs left to their holder) never hide the ones
-- behind them.
-- The first claim stamps the job with the device that computes it; a claim on
-- another device counts a move (the same weights round otherwise there, so the
-- rest is not what an uninterrupted run would have said) and names the device
-- it came from.
-- A job stamped with another model's digest is left for a worker serving that
-- model: its token ids mean nothing to this one.
-- A parked job whose checkpoint lives in another live worker process is left to
-- that process for `affinity seconds` after it was parked, or as long as the job
-- has run if that is longer (another worker would replay it token by token, which
-- costs about that); then anyone may take it.
-- A job still recorded on the claiming sequence (its end lost in a failover)
-- is requeued first.
-- A claimed job takes its tenant's fair turn (lib.lua's fair_claimed).
-- A job of a tenant with max_running (its record's `max_running`) is passed
-- over while that many of the tenant's jobs run (its live set, Keys.live_of).
-- Returns {id, execution token, the device it moved from or '', the key it runs
-- at} or false when
-- nothing fits.
-- A job Redis still records on this sequence (its end was lost, as in a
-- failover to a replica that had not received it; a sequence claims only when
-- it runs nothing) goes back to the queue first, fenced, no crash counted.
local stale = redis.call('HGET', KEYS[2], 'job')
if stale then
  local old = ARGV[1] .. stale
  local old_state = redis.call('HGET', old, 'state')
  if token(old) == redis.call('HGET', KEYS[2], 'exec')
      and (old_state == S.running or old_state == S.parking) then
    move(old, S.queued)
    redis.call('HINCRBY', old, 'exec', 1)
    redis.call('ZADD', KEYS[1], requeue_score(old, redis.call('HGET', KEYS[2], 'key')), stale)
    fair_wait(old)
  end
end
local claimable = state_set(ARGV[4])
local now = tonumber(ARGV[3])
local affinity = tonumber(ARGV[5])
local page = tonumber(ARGV[6])
local limit = tonumber(ARGV[11])
local look = tonumber(ARGV[13])
local first = 0
local live_base = string.match(ARGV[1], '^(.*):job:$')
local running_states = {[S.running] = true, [S.parking] = true}
local full = {}  -- tenant: at its max_running (read once per claim)

-- Whether this worker may take the waiting job `id`, whose record's fields
-- are `f` (FIELDS).
local function fits(id, job, f)
  if ARGV[8] ~= '' and f[2] and f[2] ~= ARGV[8] then
    return false
  elseif f[1] == S.parked then
    local p = redis.call('HMGET', job, 'ckpt_worker', 'parked_at', 'run_seconds')
    local holder, parked_at, ran = p[1], tonumber(p[2] or '0'), tonumber(p[3] or '0')
    if holder and holder ~= ARGV[9] and now - parked_at < math.max(affinity, ran) then
      local alive = tonumber(redis.call('ZSCORE', KEYS[4], holder) or '0')
      if alive > now then return false end
    end
  end
  local cap = tonumber(f[3] or '') or 0
  if cap > 0 and live_base then
    local live = live_base .. ':live:' .. (f[4] or '')
    if full[live] == nil then
      full[live] = count_live(live, ARGV[1], running_states) >= cap
    end
    if full[live] then return false end
    redis.call('SADD', live, id)  -- (a job queued before its tenant had caps)
  end
  return true
end

-- Whether this worker may take the waiting job `id` (fits, its record read).
local function fits_id(id)
  local job = ARGV[1] .. id
  return fits(id, job, redis.call('HMGET', job, 'state', 'model_digest', 'max_running', 'owner'))
end

-- The job to take: the first that fits; where it takes a fair turn, the
-- first waiting job that fits of the tenant whose turn at its level is the
-- earliest (lib.lua), looking at the 4 x `look` earliest turns (a tenant whose
-- first waiting job does not fit is passed over; equal turns go to the first
-- that fits's tenant, else by score).
-- The job taken runs in the first one's place (its key: a waiting job that
-- beats it would have beaten that one).
local best, head_score
while first < limit and not best do
  local top = redis.call('ZRANGE', KEYS[1], first, first + page - 1)
  if #top == 0 then break end
  local removed = 0
  for _, id in ipairs(top) do
    local job = ARGV[1] .. id
    local f = redis.call('HMGET', job, 'state', 'model_digest', 'max_running', 'owner')
    if not f[1] or not claimable[f[1]] then
      redis.call('ZREM', KEYS[1], id)  -- stale entry: the job ended meanwhile
      removed = removed + 1
    elseif fits(id, job, f) then
      best = id
      break
    end
  end
  if not best then first = first + #top - removed end
end
if not best then return false end
head_score = tonumber(redis.call('ZSCORE', KEYS[1], best))

local id, turn = best, nil
local base, level, owner = fair_of(ARGV[1] .. best)
if base and live_base then
  local heads = base .. ':heads:' .. level
  turn = tonumber(redis.call('ZSCORE', heads, owner)) or fair_turn(base, level, owner)
  local pick_score = head_score
  -- Its tenant's first waiting job, if it fits (the first that fits may be
  -- a later one of the tenant's, in an earlier one's place).
  local own_tq = base .. ':tq:' .. level .. ':' .. owner
  local own = nil
  if redis.call('ZSCORE', own_tq, best) then  -- (not a job queued before its tenant had a queue)
    own = fair_first(own_tq, KEYS[1], ARGV[1], claimable, look)
  end
  if own and own ~= best and fits_id(own) then
    id, pick_score = own, tonumber(redis.call('ZSCORE', KEYS[1], own))
  end
  local mine = true
  local at, done = 0, false
  while not done and at < 4 * look do
    -- (in pages: a claim mostly stops at the first turn)
    local rows = redis.call('ZRANGE', heads, at, at + 7, 'WITHSCORES')
    if #rows == 0 then break end
    at = at + 8
    for i = 1, #rows, 2 do
      local tenant, t = rows[i], tonumber(rows[i + 1])
      -- In order of turns: none after is earlier. An equal turn goes to the
      -- first that fits's tenant, else by score.
      if t > turn or (t == turn and mine) then
        done = true
        break
      end
      if tenant ~= owner then
        local tq = base .. ':tq:' .. level .. ':' .. tenant
        local other, empty = fair_first(tq, KEYS[1], ARGV[1], claimable, look)
        if empty then
          redis.call('ZREM', heads, tenant)
          at = at - 1  -- (the rows after it moved up one)
        elseif other then
          local score = tonumber(redis.call('ZSCORE', KEYS[1], other))
          if (t < turn or score < pick_score) and fits_id(other) then
            id, turn, pick_score, mine = other, t, score, false
          end
        end
      end
    end
  end
  if id ~= best then
    -- The first takes the place of the one taken: the level's places in the
    -- queue, and so every other level's, are as they would be without turns.
    -- A parked one left to its checkpoint's holder is left to it no more (its
    -- holder gave its place away; another process may take it, by replay).
    redis.call('ZADD', KEYS[1], string.format('%.17g', pick_score), best)
    redis.call('HDEL', ARGV[1] .. best, 'ckpt_worker')
  end
end

local job = ARGV[1] .. id
redis.call('ZREM', KEYS[1], id)
redis.call('HINCRBY', job, 'exec', 1)
redis.call('HSET', job, 'nonce', ARGV[12])
local exec = token(job)
if live_base then fair_claimed(job, id, turn) end
move(job, S.running)
redis.call('HSET', job, 'worker', ARGV[2], 'resumed_at', ARGV[3])
redis.call('HSETNX', job, 'started_at', ARGV[3])
local key = string.format('%.17g', -head_score)  -- (the place it runs in)
redis.call('HSET', KEYS[2], 'job', id, 'exec', exec, 'since', ARGV[3], 'key', key,
           'pinned', ARGV[7])
redis.call('HDEL', KEYS[2], 'preempt')
redis.call('ZADD', KEYS[3], key, ARGV[2])
local was = redis.call('HGET', job, 'device')
local moved = ''
if not was then
  redis.call('HSET', job, 'device', ARGV[10])
elseif was ~= ARGV[10] then
  moved = was
  redis.call('HSET', job, 'device', ARGV[10])
  redis.call('HINCRBY', job, 'device_moves', 1)
end
return {id, exec, moved, key}
