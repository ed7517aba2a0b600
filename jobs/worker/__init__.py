"""The worker process: the room that joins the engine and the store.

``loop`` (claim the best jobs, step them, repeat; ``Worker``), ``execution``
(one claimed job: claim -> plan -> drive -> apply), ``runner`` (one
generation's engine calls as a coroutine), ``generation`` (its state between
steps), ``sequences`` (where each job's KV lives), ``chunks`` (OpenAI streaming
chunks) and ``stepclock`` (where stepping time goes).
"""
