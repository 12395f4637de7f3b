"""The machinery under ``leakcheck.Tracker``: what is read, when, and where it is kept.

``Sampler`` (sampler.py) says when to read and reads, into a
``ProcessTable`` (table.py: every process of the job, its role and GPU bytes) and an
``EpochBook`` (book.py: epochs, peaks, end states, the workers' own reports); ``Pacing``
(pacing.py) is the pure policy of what to read when, reads.py the timed reads and their
cost, claims.py whose each process is among several trackers. Nothing here judges.
"""
