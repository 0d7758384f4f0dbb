"""exactresume's benchmarks: every figure a ratio against a baseline measured in the same run.

    make bench                      # all presets, writes runs/bench/bench.json and prints the table
    python -m bench --toy           # seconds: the harness end to end on a toy size (figures meaningless)
    python -m bench.table docs/bench.json --readme docs/performance.md   # regenerate the Performance block

Baseline and candidate repetitions are interleaved (A B A B ..., the order rotating each round) so a
noisy, shared machine slows both alike; the first round only warms buffers and is discarded.
"""
