"""`exactresume doctor`: a user's own training script run straight, interrupted and resumed under a
tracer, and the first piece of state its resume loses, named.

    command   the flags and the verdict on the terminal
    check     check_resume: the same runs from Python, the verdict as a value (a test users keep)
    examine   the three runs, and the files moved aside and put back between them
    run       one traced run: the child's environment, its trace read back
    diagnose  alignment, the determinism check, the first difference, the missing state
    causes    from the first differing fingerprints to a cause in the user's words
    verdict   report.md and doctor.png
    tracer/   what runs inside the user's process; it imports nothing of ours (lint-imports checks)
"""
