"""The programs of a run's group tasks, serving the head over the control bus.

    trainer.py     TrainerRole: one trainer rank (TrainerEngine under FSDP2 over gloo/NCCL)
    inference.py   InferenceRole: one vLLM engine (a replica), hpcrl's weight-transfer engine inside
    reward.py      RewardRole: a RewardPool (worker processes, per-sample timeout)
    serve.py       a task's life: register on the bus, build the role, serve its endpoints, exit
    reaper.py      the supervisor process every task runs under: ends what the task leaves running,
                   tells the head the task's exit code
    __main__.py    `python -m hpcrl.roles GROUP`: what the head's steps start

Every role exposes endpoints (name -> (async fn, idempotent)); engine work runs on one thread per
role, in the order the head sent it, so collectives of trainer ranks line up.
"""
