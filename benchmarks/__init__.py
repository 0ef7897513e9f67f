"""
What serves only measurement: bench.py's modes and its GPU report, kept apart from the product. bench.py
and the tests import it; the project's own code (the scripts at the root and lib/) never does, so that a
user reads the trainer without the workshop (tests/test_layout.py checks it).
"""
