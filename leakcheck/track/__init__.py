"""The machinery under ``leakcheck.Tracker``: what is read, when, and where it is kept.

``Tracker`` (tracker.py) runs a job's lifecycle over its sampler thread (sampler.py), which
reads into a ``ProcessTable`` (table.py) and an ``EpochBook`` (book.py); claims.py says whose
each process is among several trackers. Nothing here judges.
"""
