"""What you run, above the server: the ``parkq`` command and its subcommands,
the process launcher and gunicorn, logging setup, the HTTP clients behind
``parkq demo``, ``parkq batch`` and ``parkq soak``, and every benchmark
(``tools/bench/``). Imports go down only: tools -> web -> jobs -> scheduler."""
