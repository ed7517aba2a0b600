-- Drop what of the tenants' fair turns no longer counts (scheduler/fairness.py,
-- lib.lua): a tenant from a level's turns once its queue there holds no job
-- still waiting (entries of jobs that ended other than by a claim or a cancel
-- are dropped, `budget` of them per tenant a sweep: lib.lua's fair_first), a
-- clock of a tenant with nothing waiting at the level that its virtual time
-- has passed (its next turn is the level's then), and release 0.2.0's fields.
-- KEYS: the fair hash, the queue zset
-- ARGV: the job key prefix, the keys' base, the budget
local all = redis.call('HGETALL', KEYS[1])
local v = {}
for i = 1, #all, 2 do
  local level = string.match(all[i], '^v|(.*)$')
  if level then v[level] = tonumber(all[i + 1]) or 0 end
end
local waiting = {[S.queued] = true, [S.parked] = true}
local budget = tonumber(ARGV[3])
for level, _ in pairs(v) do
  local heads = ARGV[2] .. ':heads:' .. level
  for _, tenant in ipairs(redis.call('ZRANGE', heads, 0, -1)) do
    local tq = ARGV[2] .. ':tq:' .. level .. ':' .. tenant
    local _, empty = fair_first(tq, KEYS[2], ARGV[1], waiting, budget)
    if empty then redis.call('ZREM', heads, tenant) end
  end
end
for i = 1, #all, 2 do
  local field = all[i]
  local head = string.sub(field, 1, 2)
  if head == 'g|' or string.sub(field, 1, 5) == 'g_at|' then
    redis.call('HDEL', KEYS[1], field)
  elseif head == 'c|' then
    local level, tenant = string.match(field, '^c|([^|]*)|(.*)$')
    local clock = tonumber(all[i + 1])
    if not clock or not level then
      redis.call('HDEL', KEYS[1], field)
    elseif clock <= (v[level] or 0)
        and not redis.call('ZSCORE', ARGV[2] .. ':heads:' .. level, tenant) then
      redis.call('HDEL', KEYS[1], field)
    end
  end
end
return #all / 2
