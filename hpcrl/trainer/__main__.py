"""`python -m hpcrl.trainer`: one task of the trainer group (see hpcrl.launch.group)."""

from hpcrl.launch.group import main

if __name__ == "__main__":
    raise SystemExit(main("trainer"))
