"""Spawned worker processes, and the sandbox their untrusted code runs in: what the reward pool and the
environment pool both build on.

  process.py        a spawned worker answering JSON calls over a pipe (Worker, serve, start_workers) and
                    the `check_at_start` every worker runs as it starts
  sandbox.py        run a completion's code (and, in a second sandbox it cannot reach, its tests) in
                    throw-away bubblewrap sandboxes under CPU, memory, process, output and wall limits
  confine.py        the sandbox's walls: bubblewrap's command line and a cgroup per call
  _sandbox_boot.py  the sandbox's first code (standard library only): runs the code, serves it, runs tests
"""
