"""Every public op's docstring states its arguments and returns, and its example runs."""
from __future__ import annotations

import doctest
import inspect

import pytest

import retrofit.ops as ops

PUBLIC = sorted(name for name in ops.__all__ if not inspect.isclass(getattr(ops, name)))


@pytest.mark.parametrize("name", PUBLIC)
def test_docstring_has_args_returns_and_an_example_that_runs(name):
    doc = getattr(ops, name).__doc__ or ""
    assert "Args:" in doc and "Returns:" in doc, f"{name}: no Args / Returns section"
    test = doctest.DocTestParser().get_doctest(doc, {}, f"retrofit.ops.{name}", None, 0)
    assert test.examples, f"{name}: no example"
    report: list[str] = []
    runner = doctest.DocTestRunner(optionflags=doctest.NORMALIZE_WHITESPACE)
    runner.run(test, out=report.append)
    assert runner.failures == 0, "".join(report)
