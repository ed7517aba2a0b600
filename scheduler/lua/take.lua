-- Take a request's tokens from its tenant's bucket (web/limits.py).
-- KEYS: bucket hash. ARGV: now, tokens per minute, cost.
-- Returns '0' when taken, else the seconds until the cost would fit.
return tostring(take_tokens(KEYS[1], tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])))
