"""The RL layer: GRPO maths (`hpcrl.rl.grpo`, pure tensor functions) and the head controller."""
