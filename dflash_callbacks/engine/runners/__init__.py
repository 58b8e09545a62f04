"""Where scoring runs, behind one protocol (`jobs.Scorer`): the queue and its thread (background.py), and
one scorer a file: in this process (thread_scorer.py), in a worker process (process_scorer.py, which runs
process_worker.py), or by a watcher elsewhere (external_scorer.py). Nothing here makes what is shown of a
report: the publisher hands the runner what it wants made off the training thread (`prepare`). Nothing is
imported here: the worker process imports process_worker.py before torch loads."""
