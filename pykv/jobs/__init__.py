"""Jobs that drive vLLM engines: ``calibrate``, ``warm``, ``demo``, the tiny test model, ``serve``'s launch.

Each job runs its engine in a process of its own (vLLM's engine wants a ``__main__``
guard and leaves helper processes behind), started and stopped by the one runner
(``pykv.jobs.runner``), and reports through the one progress protocol
(``pykv.jobs.progress``, JSON lines). The caller side of a job imports neither vLLM
nor torch; the engine side imports vLLM only through ``pykv.connector.compat``.
"""
