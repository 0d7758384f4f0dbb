"""`python -m exactresume ...`: the `exactresume` command (cli.py)."""

from exactresume.cli import run_command_line

run_command_line()
