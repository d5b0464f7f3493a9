"""Launching a run: the run directory, the head, the group processes and their report.

    rundir.py   the run directory: resolved config, launch.json, job record, logs, exit record
    layout.py   launch.json: what the head needs to start the groups (from the JobSpec)
    report.py   the minimal TCP/JSON-lines protocol between group processes and the head
                (one module, to be replaced by the ZeroMQ bus of hpcrl.bus)
    steps.py    starting a group: `srun --het-group=i`, an srun on a node range (split), or
                local process trees
    head.py     the head: starts every group, collects reports, propagates exit codes
    group.py    the program each group task runs (`python -m hpcrl.trainer`, ...)
    submit.py   config -> run directory -> rendered script -> submitted job (slurm or local)
    jobs.py     status, logs and cancel of a submitted run
"""
