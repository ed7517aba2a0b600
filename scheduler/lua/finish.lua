-- End a job's execution in a terminal state, with its last events.
-- A finished job's usage (its `usage` field) is counted for its tenant.
-- Its output tokens move its tenant's usual output (lib.lua's fair_output).
-- KEYS: job hash, events stream, worker hash, running zset, counters hash,
--       this hour's usage hash, the fair hash
-- ARGV: execution token, channel, target state, allowed source states
--       (comma separated), now, ttl, worker name, sequence number of the first
--       payload (0: right after the stream's last event), number of
--       field/value pairs N, N field/value pairs, then (after the pairs) the
--       usage hash's ttl, then payloads.
-- Returns -1 when the execution token is stale, -2 when the job's state does
-- not allow the transition, {-3, n} when a replayed event n differs from the
-- stored one (the job is left as it was), {-4, n} when the stream holds only n
-- events, fewer than these follow (writes lost in a failover; the job is left
-- as it was), 1 when done.
if token(KEYS[1]) ~= ARGV[1] then
  return -1
end
if not state_set(ARGV[4])[redis.call('HGET', KEYS[1], 'state')] then
  return -2
end
local n = tonumber(ARGV[9])
local usage_ttl = tonumber(ARGV[10 + 2 * n])
local _, diverged = emit_numbered(KEYS[1], KEYS[2], ARGV[2], tonumber(ARGV[8]), 11 + 2 * n)
if diverged > 0 then
  return {-3, diverged}
elseif diverged < 0 then
  return {-4, tonumber(redis.call('HGET', KEYS[1], 'seq'))}
end
local tokens_before = tonumber(redis.call('HGET', KEYS[1], 'tokens') or '0')
if n > 0 then
  redis.call('HSET', KEYS[1], unpack(ARGV, 10, 9 + 2 * n))
end
local tokens_after = tonumber(redis.call('HGET', KEYS[1], 'tokens') or '0')
if tokens_after > tokens_before then
  redis.call('HINCRBY', KEYS[5], 'tokens', tokens_after - tokens_before)
end
if ARGV[3] == S.finished and KEYS[6] then
  local ok, u = pcall(cjson.decode, redis.call('HGET', KEYS[1], 'usage') or 'null')
  if ok and type(u) == 'table' then
    -- A response of n choices counts its prompt once (choice 0's job says so).
    local prompt = tonumber(redis.call('HGET', KEYS[1], 'usage_prompt') or u['prompt_tokens'])
    count_usage(KEYS[6], KEYS[5], KEYS[1], 'prompt', prompt, usage_ttl)
    count_usage(KEYS[6], KEYS[5], KEYS[1], 'completion', tonumber(u['completion_tokens']),
                usage_ttl)
    count_usage(KEYS[6], KEYS[5], KEYS[1], 'requests', 1, usage_ttl)
    fair_output(KEYS[7], KEYS[1], tonumber(u['completion_tokens']))
  end
elseif KEYS[6] then  -- cancelled or failed: what it generated all the same
  count_usage(KEYS[6], KEYS[5], KEYS[1], 'unfinished', tokens_after, usage_ttl)
end
-- A job of a tenant with max_running frees a place: an idle worker may now take
-- a job the claim passed over (else it finds it at its next wait's end).
if redis.call('HEXISTS', KEYS[1], 'max_running') == 1 then
  local base = string.match(KEYS[1], '^(.-):job:')
  if base then
    redis.call('LPUSH', base .. ':wake', redis.call('HGET', KEYS[1], 'id') or '')
    redis.call('LTRIM', base .. ':wake', 0, 63)
  end
end
end_job(KEYS[1], KEYS[2], ARGV[3], ARGV[5], ARGV[6])
release_worker(KEYS[3], KEYS[4], ARGV[7], ARGV[1])
return 1
