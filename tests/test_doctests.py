"""Every docstring example in optaxdist runs (doctest), with ``comm``/``c`` an ``AxisComm``."""

import doctest
import importlib
import pkgutil

import jax
import jax.numpy as jnp
import optax
import pytest

import optaxdist


def _modules():
    for info in pkgutil.walk_packages(optaxdist.__path__, "optaxdist."):
        if not info.name.startswith(("optaxdist.bench", "optaxdist.__main__")):
            yield info.name


def _examples():
    finder = doctest.DocTestFinder(exclude_empty=True)
    for name in sorted(_modules()):
        module = importlib.import_module(name)
        for test in finder.find(module, name):
            if test.examples:
                yield pytest.param(test, id=test.name)


@pytest.mark.parametrize("test", list(_examples()))
def test_docstring_example(test):
    comm = optaxdist.AxisComm(optaxdist.REPLICA_AXIS)
    test.globs.update(jax=jax, jnp=jnp, optax=optax, optaxdist=optaxdist, comm=comm, c=comm)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    with jax.numpy_dtype_promotion("standard"):  # users' code runs with JAX's default promotion
        runner.run(test)
    assert runner.failures == 0, f"{runner.failures} of {runner.tries} examples failed in {test.name}"
