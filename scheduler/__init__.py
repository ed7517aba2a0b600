"""The scheduling policy of parkq, pure: no Redis, no clock, no engine.

Everything here takes its inputs as arguments (``now`` included) and returns
plain values, so the rules can be tested without any I/O.
"""
