"""The `hpcrl` command line."""
