"""
The project's library: what the scripts at the root (train.py, prepare.py, sample.py, eval.py, export.py,
bench.py, plot.py) are made of, one module per concern. Imports run one way: the scripts import lib (and
configurator.py, model.py and kernels.py where they need them), lib imports model.py and kernels.py, model.py
imports kernels.py, and kernels.py nothing of the project's (tests/test_layout.py checks it).
"""
