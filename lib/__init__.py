"""
The project's library: what the scripts at the root (train.py, prepare.py, sample.py, eval.py, export.py,
bench.py, plot.py) are made of, one module per concern. Imports run one way: the scripts import lib (and
configurator.py and model.py where they need them), lib imports model.py, and model.py nothing of the project's
at its top: kernels.py's fused ops, which build on model.py's math, it imports where a call runs one
(tests/test_layout.py checks it).
"""
