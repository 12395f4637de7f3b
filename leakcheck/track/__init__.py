"""The machinery under ``leakcheck.Tracker``: what is read, when, and where it is kept.

``Sampler`` (sampler.py) reads, when ``Pacing`` (pacing.py) says, into a ``ProcessTable``
(table.py: every process of the job) and an ``EpochBook`` (book.py: one row per process per
epoch); reads.py times the reads, claims.py says whose each process is among several
trackers. Nothing here judges.
"""
