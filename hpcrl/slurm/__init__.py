"""Slurm layer: sbatch rendering, the allocation seen from inside a job, job tracking.

    spec.py      Config -> JobSpec: one sbatch block per component (pure, validated)
    render.py    JobSpec -> the batch script text (pure; golden files in sbatch/golden/)
    nodelist.py  Slurm host lists ("n[2-3,5]") expanded
    identity.py  which group, replica and rank a task is, from its environment (pure)
    tracking.py  job state from sacct, or squeue where accounting is off; hetjob ids N+i
    executor.py  the only module importing submitit: hetjob executor and local executor

Nothing here imports submitit at import time; `hpcrl plan` stays fast.
"""
