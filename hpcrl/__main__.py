"""`python -m hpcrl ...` is the same as the `hpcrl` console script."""

from hpcrl.cli.main import main

if __name__ == "__main__":
    raise SystemExit(main())
