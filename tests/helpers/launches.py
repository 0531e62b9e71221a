"""Checks of the launches a stand-in kernel logged (the ``stand_in_kernels`` fixture)."""

import torch


def assert_launched_as_computed(launched, args, constexprs, parameters):
    """A logged compiled launch's full argument list ``launched`` is the launch the launcher
    computes: ``args`` (tensors by address, as a repeat passes the caller's tensor where the
    launcher passed a view of it; everything else by value), then every remaining kernel
    parameter from ``constexprs`` or its default (``parameters``: the kernel's, in order)."""
    assert len(launched) == len(parameters)
    for got, want in zip(launched, args):
        if isinstance(want, torch.Tensor):
            assert isinstance(got, torch.Tensor) and got.data_ptr() == want.data_ptr()
        else:
            assert got == want
    names = list(parameters)[len(args):]
    assert tuple(launched[len(args):]) == tuple(constexprs.get(name, parameters[name].default) for name in names)
