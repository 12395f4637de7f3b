"""The machinery under ``leakcheck.Tracker``: what is read, when, and where it is kept.

``Sampler`` (sampler.py) says when to read: its thread is a ``Ticker`` (ticker.py), and
each sample a ``SampleReader``'s (sample_reader.py), which keeps what it reads in a
``ProcessTable`` (table.py: every process of the job, its role and GPU bytes) and an
``EpochBook`` (book.py: epochs, peaks, end states, the workers' own reports). When
to read what is decided by ``Pacing`` (pacing.py), a pure object driven by the times it is
given; ``CostMeter`` (cost.py) counts what tracking costs; ``claims`` (claims.py) tells
several trackers of one process whose each process is. Nothing here judges: the output is
a ``Timeline`` for ``leakcheck.judge.verdict``.
"""
