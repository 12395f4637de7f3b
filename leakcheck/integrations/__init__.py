"""The public path of the framework adapters: ``leakcheck.integrations.lightning``."""
