"""`python -m hpcrl.inference`: one task of the inference group (see hpcrl.launch.group)."""

from hpcrl.launch.group import main

if __name__ == "__main__":
    raise SystemExit(main("inference"))
