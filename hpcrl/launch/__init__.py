"""Launching a run: submit it, start and watch its groups from the head, follow it.

    submit.py      config -> run directory -> rendered script -> submitted job (slurm or local)
    head.py        the job's entry, the head (component 0): binds the bus, runs the program (check,
                   or rl: hpcrl.rl.program), records the end (exit.json), requeues after a loss
    supervisor.py  the head's process supervisor: one step per group, the task table from the
                   bus's peer events, lost inference replicas started again, failures named
    steps.py       starting a group: `srun --het-group=i`, an srun on a node range (split), or
                   local process trees
    follow.py      a submitted run from the login node: status, logs, cancel, wait
    inprocess.py   `hpcrl run`: every group of a run in this one process, driven by the same
                   Controller and Ports as a job's
"""
