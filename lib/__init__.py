"""
The project's library: what the scripts at the root (train.py, prepare.py, sample.py, eval.py, export.py,
bench.py) are made of, one module per concern. Imports run one way: the scripts import lib, lib imports
model.py and kernels.py, model.py imports kernels.py, and kernels.py only torch (tests/test_layout.py checks it).
"""
