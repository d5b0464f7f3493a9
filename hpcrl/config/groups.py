"""The groups a run is made of, named once: the config's [groups.<name>] tables, the Slurm components,
the bus's peer groups, the roles' tasks and `hpcrl logs --group` all spell them from here.

    from hpcrl.config.groups import TRAINER
    config.group(TRAINER).gpus_per_node
"""

from __future__ import annotations

HEAD = "head"
"""The head: the controller and the bus's router (the hetjob's component 0)."""
TRAINER = "trainer"
INFERENCE = "inference"
REWARD = "reward"

#: The Slurm components a run is made of, in heterogeneous-job order.
GROUP_NAMES = (HEAD, TRAINER, INFERENCE, REWARD)
#: The groups whose tasks serve the head over the bus (`python -m hpcrl.roles <group>`).
TASK_GROUPS = (TRAINER, INFERENCE, REWARD)
