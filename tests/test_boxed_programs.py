"""A lowered program run boxed frees each argument after its last use (lowering.boxed_twin,
LocalProgram.run_boxed), as eager autograd frees a saved tensor once its backward node ran: the
stage runtime passes a backward its saved activations this way."""

from __future__ import annotations

import weakref

import torch
import torch.fx as fx

from autoplan.runtime.lowering import LocalProgram, boxed_twin

_seen: list[bool] = []
_watched: list[weakref.ref] = []


def _probe(x: torch.Tensor) -> torch.Tensor:
    _seen.append(_watched[0]() is not None)
    return x


torch.fx.wrap("_probe")


def _program(ref: weakref.ref) -> fx.GraphModule:
    """``a`` last read by the first op; ``_probe`` then reports whether ``a`` (``ref``) is still alive."""
    _watched[:] = [ref]
    graph = fx.Graph()
    a, b = graph.placeholder("a"), graph.placeholder("b")
    first = graph.call_function(torch.ops.aten.add.Tensor, (a, 1))
    probed = graph.call_function(_probe, (b,))
    graph.output([first, probed])
    return fx.GraphModule(torch.nn.Module(), graph)


def test_a_boxed_program_frees_an_argument_after_its_last_use_and_empties_the_list() -> None:
    a, b = torch.ones(1000), torch.ones(3)
    ref = weakref.ref(a)
    gm = _program(ref)
    args = [a, b]
    del a
    _seen.clear()
    out = LocalProgram(graph_module=gm, output_layouts=(None, None)).run_boxed(args)
    assert args == []
    assert _seen == [False]  # freed before the program's next op, not when it returned
    torch.testing.assert_close(out[0], torch.full((1000,), 2.0))
    # the unboxed call holds it to the end (the caller's argument tuple)
    a2 = torch.ones(1000)
    ref2 = weakref.ref(a2)
    _seen.clear()
    _program(ref2)(a2, b)
    assert _seen == [True]


def test_the_boxed_twin_is_built_once_and_computes_what_the_program_does() -> None:
    a = torch.ones(4)
    gm = _program(weakref.ref(a))
    assert boxed_twin(gm) is boxed_twin(gm)
    _seen.clear()
    expected = gm(a, torch.ones(2))
    got = boxed_twin(gm)([a, torch.ones(2)])
    for e, g in zip(expected, got, strict=True):
        torch.testing.assert_close(e, g)
