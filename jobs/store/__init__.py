"""Everything that touches Redis.

``scheduling`` (enqueue, claim, step writes, park, finish, cancel, preempt
flags, the reaper: the typed side of ``scheduler/lua``), ``registry`` (who is
alive), ``telemetry`` (counters, histograms, the dashboard's rows),
``identity`` (what model a process serves), ``rqjobs`` (RQ's read-only view),
``batches`` (files and the Batch API), ``events`` (the payloads of a job's
stream), ``connect`` (plain and Sentinel URLs) and ``faults`` (Redis errors
told apart: passing, or not). Imports nothing from
``jobs.engine`` or ``jobs.worker``.
"""
