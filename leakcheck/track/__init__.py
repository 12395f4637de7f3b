"""The machinery under ``leakcheck.Tracker``: what is read, when, and where it is kept.

``Tracker`` (tracker.py) runs a job's lifecycle; its ``Sampler`` (sampler.py) reads, when
``Pacing`` says, into a ``ProcessTable`` (table.py: every process of the job) and an
``EpochBook`` (book.py: one row per process per epoch); claims.py says whose each process is
among several trackers. Nothing here judges.
"""
