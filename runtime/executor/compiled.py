"""`torch.compile` of one model's step function, with graphs and guards of its own, called past
Dynamo once each kind of call has run.

Dynamo keeps compiled graphs on the code object of the function it compiles, and checks a
graph's guards on every call before it runs it. Compiling `model.forward` directly has two costs:

- Every `CausalLM` in a process shares `CausalLM.forward`'s code object, so every model, mode or
  EP shard built in it (tests, bench arms, a restarted group) adds its graphs to one list, which
  each call walks, and past Dynamo's recompile limit a step would silently run eager.
- Guards on every module and parameter the graph reads (their identity, attributes, sizes):
  ~330 us of guard checks on each 4 ms one-row step of the embedded model (a profile's
  "TorchDynamo Cache Lookup").

`compile_step` compiles a copy of the function with its own code object, so the graphs it keeps
belong to this one model, and drops the guards on the model's modules (Dynamo's
`skip_guard_on_all_nn_modules_unsafe`). That is safe here because nothing reaches these graphs but
this model, whose modules never change once its runner is built (its mode, `batch_invariant`, is
set before the first compile); the guards on the step's own inputs (the row count: one row and
several rows are separate graphs) and on globals stay.

Even so, each call through Dynamo pays its frame hook, the remaining guards and the bytecode that
gathers the graph's ~80 inputs (every parameter and module attribute it reads) before the graph
runs: ~0.5 ms of a ~2.6 ms one-row step of the embedded model, ~0.14 ms of a ~0.66 ms drafter
step. So `CompiledStep` keeps the graphs Dynamo hands its backend, and where a call's arguments
have the signature of a call that already ran (`signature`) it builds that graph's inputs itself
(the model's parameters and attributes read once, the step's tensors and sizes from the call),
checks the graph's shape guards on them (Dynamo's own expression for that graph) and calls the
graph directly. A new signature, or a failed check, goes through Dynamo, which compiles or picks
the graph, and the call is recorded for the next time. vLLM's compiled models skip Dynamo's
dispatch the same way once warm.
"""
from __future__ import annotations

import logging
import types
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass

from runtime.ops import cpu_ops

log = logging.getLogger("metrale.compiled")


def own_code(method: Callable) -> Callable:
    """A bound method `obj.f` -> the same method over a copy of `f` with its own code object."""
    fn = method.__func__
    copy = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    copy.__kwdefaults__ = fn.__kwdefaults__
    copy.__qualname__ = fn.__qualname__
    copy.__doc__ = fn.__doc__
    return types.MethodType(copy, method.__self__)


def signature(args: tuple) -> tuple:
    """What Dynamo's guards on a call's arguments see, apart from exact sizes: per tensor its type,
    device, its strides unless it is contiguous, and its sizes, 0 and 1 as they are (Dynamo specialises a
    graph to them) and the others by their first position among the call's sizes (Dynamo assumes
    sizes equal when it traced equal later, "duck sizing"); any other argument by identity (ints,
    floats and strings by value); and the grad mode."""
    sizes: dict[int, int] = {}
    key: list = [torch.is_grad_enabled(), torch.is_inference_mode_enabled()]
    for a in args:
        if isinstance(a, torch.Tensor):
            dims = []
            for s in a.shape:
                dims.append(s if s < 2 else -1 - sizes.setdefault(s, len(sizes)))
            key.append((a.dtype, a.device, True if a.is_contiguous() else a.stride(), tuple(dims)))
        elif isinstance(a, (int, float, str, bool)) or a is None:
            key.append((type(a), a))
        else:
            key.append(id(a))
    return tuple(key)


@dataclass(eq=False)
class _Graph:
    """One graph Dynamo compiled: the inductor function, and where each of its inputs comes from
    (Dynamo's source expression over the frame's locals `L` and globals `G`; None: unknown)."""
    fn: Callable
    sources: list[str | None]
    as_tensor: list[bool]                    # inputs that are numbers passed as 0-d tensors
    guards: types.CodeType | None           # its shape guards over inputs t0..tn, compiled
    interp: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.names = [f"t{i}" for i in range(len(self.sources))]


@dataclass(eq=False)
class _Direct:
    """A recorded call's graph, with its inputs' builder and its result's shape."""
    graph: _Graph
    build: Callable                          # (L, S) -> the graph's inputs
    static: tuple                            # S: the inputs read once
    result: Callable                         # the graph's outputs -> what the function returns


class NativeOpsKey(CustomGraphPass):
    """A pass that changes nothing, there for its `uuid`: the native CPU library's name, which
    changes with its source (runtime.ops.cpu_ops.library_path). Inductor's on-disk cache hashes it into
    every key, so a graph compiled against another build of the native ops (whose schemas its
    C++ wrapper baked in: an argument added to an op crashed such a stale graph) is never reused."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        return None

    def uuid(self) -> str:
        return cpu_ops.library_path().name


class CompiledStep:
    """`torch.compile` (inductor, dynamic shapes) of the bound method `model.f` of one model: its
    graphs are kept for this model alone, without guards on its modules, and called directly once
    a call of the same signature has run (the module docstring). Positional arguments only on the
    direct path; anything else goes through Dynamo every time."""

    def __init__(self, method: Callable, options: dict | None = None, direct: bool = True) -> None:
        self._model = method.__self__
        code = method.__func__.__code__
        self._names = code.co_varnames[1:code.co_argcount]     # the arguments after self
        self._globals = method.__func__.__globals__
        self._direct_on = direct
        self._direct: dict[tuple, list[_Direct]] = {}
        self._declined: set[tuple] = set()     # signatures whose graph cannot be called directly
        self._recording: list[tuple[_Graph, tuple]] | None = None
        # On the CPU inductor writes the graph's own wrapper in C++ (`cpp_wrapper`): its ~100
        # buffer allocations, views and kernel calls a step cost no Python bytecode.
        device = getattr(self._model, "device", None)
        opts = {"size_asserts": False, "cpp_wrapper": getattr(device, "type", None) == "cpu",
                "post_grad_custom_post_pass": NativeOpsKey(), **(options or {}),
                "guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe}
        self._dynamo = torch.compile(own_code(method), dynamic=True, backend=self._backend, options=opts)
        self.direct_calls = 0          # calls that skipped Dynamo (for tests and profiles)

    def _backend(self, gm: torch.fx.GraphModule, example_inputs: list, options: dict | None = None) -> Callable:
        """Dynamo's backend: inductor's `compile_fx`, keeping the graph for direct calls."""
        from torch._inductor.compile_fx import compile_fx
        fn = compile_fx(gm, example_inputs, config_patches=dict(options or {}))
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        sources, as_tensor = [], []
        for node in placeholders:
            arg = node.meta.get("grapharg")
            source = getattr(arg, "source", None)
            name = None if source is None else source.name
            sources.append(name() if callable(name) else name)
            # A Python number the graph takes as a 0-d tensor (Dynamo wraps it on every call).
            as_tensor.append(bool(getattr(arg, "pass_arg_as_tensor", False)))
        guards, interp = None, {}
        try:
            from torch._guards import TracingContext
            from torch.fx.experimental.symbolic_shapes import SYMPY_INTERP
            env = TracingContext.get().fake_mode.shape_env
            if env is not None:
                # Inductor may have added guards while it compiled: they are in the env now.
                expr = env.produce_guards_expression([n.meta["example_value"] for n in placeholders])
                guards = None if expr is None else compile(expr, "<metrale graph guards>", "eval")
                interp = dict(SYMPY_INTERP)
        except Exception as exc:  # noqa: BLE001 - without its guards a graph is only called through Dynamo
            log.debug("graph guards unavailable, no direct calls to this graph: %s", exc)
            sources = [None] * len(placeholders)
        graph = _Graph(fn, sources, as_tensor, guards, interp)

        def run(*args):
            outputs = fn(*args)
            if self._recording is not None:
                self._recording.append((graph, args, outputs))
            return outputs
        return run

    def __call__(self, *args, **kwargs):
        if kwargs or not self._direct_on or len(args) != len(self._names):
            return self._dynamo(*args, **kwargs)
        key = signature(args)
        if key in self._declined:
            return self._dynamo(*args)
        entries = self._direct.get(key)
        if entries:
            local = dict(zip(self._names, args))
            local["self"] = self._model
            for entry in entries:
                inputs = entry.build(local, entry.static)
                graph = entry.graph
                if graph.guards is None or eval(graph.guards, graph.interp, {"L": dict(zip(graph.names, inputs))}):
                    self.direct_calls += 1
                    return entry.result(graph.fn(*inputs))
        return self._record(key, args)

    def _record(self, key: tuple, args: tuple):
        """A call through Dynamo; when exactly one graph ran, every input of it can be read from
        the call and the result is made of its outputs, the way to call that graph directly is
        kept under `key`."""
        self._recording = []
        try:
            out = self._dynamo(*args)
            runs = self._recording
        finally:
            self._recording = None
        entry = self._direct_entry(*runs[0], args, out) if len(runs) == 1 else None
        if entry is not None:
            self._direct.setdefault(key, []).append(entry)
        elif key not in self._direct:
            self._declined.add(key)
        return out

    def _direct_entry(self, graph: _Graph, inputs: tuple, outputs, args: tuple, out) -> _Direct | None:
        if any(s is None for s in graph.sources):
            return None
        result = _result_of(out, outputs)
        if result is None:
            log.debug("the step's result is not the graph's outputs: no direct calls")
            return None
        local = dict(zip(self._names, args))
        local["self"] = self._model
        frame = {"L": local, "G": self._globals}
        static, parts = [], []
        try:
            for source, wrap, seen in zip(graph.sources, graph.as_tensor, inputs):
                value = eval(source, frame)
                if wrap:
                    value = torch._as_tensor_fullprec(value)
                    same = isinstance(seen, torch.Tensor) and value.dtype == seen.dtype and bool(value == seen)
                else:
                    same = value is seen or (type(value) is type(seen) and not isinstance(value, torch.Tensor)
                                             and value == seen)
                if not same:
                    log.debug("graph input %s is not what the call gave it: no direct calls", source)
                    return None
                if source.startswith(("L['self']", "G[")):
                    parts.append(f"S[{len(static)}]")
                    static.append(value)      # a wrapped number wrapped once
                else:
                    parts.append(f"torch._as_tensor_fullprec({source})" if wrap else source)
            build = eval(f"lambda L, S: ({', '.join(parts)},)", {"G": self._globals, "torch": torch})
            # The graph's guards hold for the call that just ran it (else they cannot be read).
            if graph.guards is not None and not eval(graph.guards, graph.interp,
                                                     {"L": dict(zip(graph.names, build(local, tuple(static))))}):
                log.debug("graph guards do not hold for the call that ran it: no direct calls")
                return None
        except Exception as exc:  # noqa: BLE001 - an input or a guard we cannot read: this call stays with Dynamo
            log.debug("graph inputs or guards not readable (%s): no direct calls", exc)
            return None
        return _Direct(graph, build, tuple(static), result)


def _result_of(out, outputs) -> Callable | None:
    """How the function's result `out` is made of the graph's `outputs` (a tensor, or a tuple of
    them, each one of the outputs itself), or None."""
    def index(t) -> int | None:
        return next((i for i, o in enumerate(outputs) if o is t), None) if isinstance(t, torch.Tensor) else None
    if isinstance(out, torch.Tensor):
        i = index(out)
        return None if i is None else (lambda o: o[i])
    if type(out) is tuple:
        at = [index(t) for t in out]
        if any(i is None for i in at):
            return None
        return lambda o: tuple(o[i] for i in at)
    return None


def compile_step(method: Callable, options: dict | None = None) -> CompiledStep:
    """`torch.compile` (inductor, dynamic shapes, `options`) of the bound method `model.f` of one
    model: its graphs are kept for this model alone, without guards on its modules, and called
    past Dynamo once warm (`CompiledStep`)."""
    return CompiledStep(method, options)
