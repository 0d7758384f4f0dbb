"""New processes forked from a warm server of their own Python instead of started cold.

A run that must be a new process (a resume is only proven in a process that never saw the run) pays
for torch's imports each time it starts cold: seconds, more than the lab's or a test's training. A
fork server (serve.py, run by the runs' own interpreter) imports them once and forks each run from
itself; client.py starts servers and hands out a subprocess.Popen-like handle per run. The lab, the
doctor (`--warm`) and the tests start their processes through it.
"""
