"""Spawned worker processes, and the sandbox their untrusted code runs in: what the reward pool and the
environment pool both build on.

  process.py        a spawned worker answering JSON calls over a pipe (Worker, serve, start_workers) and
                    the `check_at_start` every worker runs as it starts
  sandbox.py        run a completion's code (and tests) in a throw-away process with new user, network
                    and PID namespaces and CPU, memory, process, output and wall limits
  _sandbox_boot.py  the sandbox's first code (standard library only)
"""
