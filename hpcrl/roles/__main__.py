"""`python -m hpcrl.roles GROUP [--exit-code N]`: one task of a group (the head's steps start it).

GROUP is trainer, inference or reward; see hpcrl.roles.serve for the task's life.
"""

import os
import sys

from hpcrl.config.groups import TASK_GROUPS
from hpcrl.fsio import PRIVATE_UMASK
from hpcrl.roles.serve import task_main

os.umask(PRIVATE_UMASK)  # checkpoint shards, logs and vLLM's files in the run directory: the owner's only

if len(sys.argv) < 2 or sys.argv[1] not in TASK_GROUPS:
    print(f"usage: python -m hpcrl.roles {{{'|'.join(TASK_GROUPS)}}} [--exit-code N]", file=sys.stderr)
    raise SystemExit(2)
raise SystemExit(task_main(sys.argv[1], sys.argv[2:]))
