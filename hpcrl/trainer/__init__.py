"""The trainer role (FSDP2 ranks); for now its tasks run hpcrl.launch.group."""
