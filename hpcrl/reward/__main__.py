"""`python -m hpcrl.reward`: one task of the reward group (see hpcrl.launch.group)."""

from hpcrl.launch.group import main

if __name__ == "__main__":
    raise SystemExit(main("reward"))
