-- Add one observation to a latency histogram.
-- KEYS: histogram hash
-- ARGV: bucket (its upper bound, or '+Inf'), value (ms)
observe(KEYS[1], ARGV[1], 1, tonumber(ARGV[2]))
