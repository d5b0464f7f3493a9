"""The inference role (vLLM engines); for now its tasks run hpcrl.launch.group."""
