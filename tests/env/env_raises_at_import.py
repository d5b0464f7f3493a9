"""An environment module that fails as it is imported (a missing data file, say)."""

from pathlib import Path

WORDS = Path("/nonexistent/hpcrl-test-words.txt").read_text().split()


class Guess:
    def reset(self, row):
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, messages):
        return [], 1.0, True
