"""Adapters for training frameworks: each feeds ``leakcheck.Tracker`` and uses its ``Report``.

Every module here is imported only by its user (``import leakcheck`` imports none of them, and
none imports its framework before that): ``leakcheck.integrations.lightning`` needs
``pip install "dataloader-leakcheck[lightning]"``. Like ``watch()`` and the pytest plugin, an
adapter never imports another adapter and never judges on its own (DESIGN.md, layers).
"""
