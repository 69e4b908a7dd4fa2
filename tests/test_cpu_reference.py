"""backend.cpu_reference: a device check's one-off reference runs on the CPU, uncompiled, and compilation
comes back on afterwards (a compiled function traces once again)."""

import mlx.core as mx

from kvcore.backend import cpu_reference


def test_reference_runs_uncompiled_and_compile_returns():
    traces = []

    def f(x):
        traces.append(1)  # runs when traced (compiled) or on every call (uncompiled)
        return x * 2 + 1

    g = mx.compile(f)
    x = mx.array([1.0, 2.0])
    with cpu_reference():
        a, b = g(x), g(x)
        mx.eval(a, b)
    assert len(traces) == 2  # compilation off: each call ran the Python function
    assert a.tolist() == [3.0, 5.0]
    traces.clear()
    h = mx.compile(f)
    mx.eval(h(x), h(x))
    assert len(traces) == 1  # compilation back on: traced once, then reused
