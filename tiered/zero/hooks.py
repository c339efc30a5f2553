"""Module hooks, autograd boundary functions and the forward-time modes. They only dispatch.

[Note: hooks that only dispatch]
Every hook here forwards to one method of its `HookTarget` (the coordinator, `ZeroParameters`);
no state lives here. Per module:
a forward pre-hook gathers the module's groups; a forward post-hook (``always_call``) releases
them and wraps the grad-requiring tensors of its output in `CallInBackward`, whose backward runs
before the module's backward: the moment to gather them again (DeepSpeed's
PreBackwardFunction pattern). In backward a group is released when all its gradients have
arrived (see [Note: gradient flush]); frozen groups after a short delay. Inputs are NOT wrapped
in a post-backward function as DeepSpeed does: an extra autograd node per module input changes
the order in which the engine sums gradients of a tensor with several consumers (q, k and v
projections of one hidden state), which made Llama gradients differ from plain PyTorch in the
last bit; without it they are bitwise equal. Gathering is never left to luck: a gradient
pre-hook on each parameter and the saved-tensor hooks below re-gather on demand whatever
backward touches while released.

[Note: saved tensors and external parameters]
Autograd saves tensors for backward that are *views* of a gathered buffer (``weight.t()`` inside
``F.linear``), not the parameter itself; a view keeps the old storage and would survive the
release, unaccounted and possibly reused. During the engine's forward a
``saved_tensors_hooks`` pair replaces any saved tensor whose bytes lie in a gathered buffer by
a reference (group, offset, shape, stride); unpacking re-gathers the group if needed and
rebuilds the view. So backward is correct even where no `CallInBackward` fired (a module whose
output we could not traverse), and released memory is really released.
A `TorchFunctionMode`, also active only during the engine's forward, sees a managed parameter
that is not gathered being used by an op (``F.linear(x, self.other.weight)``, a tied weight used
outside its module): it gathers it on demand and records it under the running module, so the
next forward gathers (and prefetches) it with that module. Nothing is patched onto torch.

[Note: partitioned parameters outside forward]
A released parameter's ``.data`` is the empty placeholder, so outside forward ``p.sum()`` would
quietly return 0 and ``model.save_pretrained`` (through ``state_dict``'s ``detach``) would write
empty tensors. The placeholder cannot refuse: ``p.data = t`` copies its metadata, not its Python
class. So while the hooks are installed, each managed ``nn.Parameter`` has its class switched
to `PartitionedParameter` (and back by `remove`), whose ``__torch_function__`` runs every op as
``nn.Parameter`` does, except that an op reading a released parameter (no elements where its
shard group says it has some) raises `ParameterNotGatheredError` naming the parameter and the
calls that give the values: ``engine.gathered_parameters``, ``engine.save_pretrained``,
``engine.close``. Metadata stays readable (shape, dtype, device, ``.grad``, ``numel``), which
the hooks, autograd and Hugging Face read; ``shape`` and ``numel()`` are the placeholder's (0), as
under DeepSpeed, and ``ds_numel``, ``ds_shape`` and ``ds_tensor`` answer as DeepSpeed's do (peft
and scripts that count parameters read them). ``detach()`` (what a module's ``state_dict()``
calls) hands out the empty placeholder, as DeepSpeed's ZeRO-3 ``state_dict()`` does, guarded as
below, so that saving it raises instead of writing empty tensors. A property that hands out a tensor of the released
parameter (``.data``, ``.T``, ``.mT``, ``.real``, ...) hands out that empty tensor as a
`ReleasedData`, which answers the same metadata and raises the same error on every other op
(``p.data.sum()``, ``.clone()``, ``.numpy()``, ``.copy_()``, ``copy.deepcopy(p)`` and pickling,
which go through ``p.data``). Only released parameters pay for this: a gathered one's ``.data``
is its plain full tensor, and the engine's own moves (``p.data = full``, ``p.data.numel()``) run
with torch-function handling off (`HookSet`) or read metadata only. In forward
ExternalParamMode runs first and gathers such a parameter, so the op then sees it gathered. A
parameter that is not a plain ``nn.Parameter`` (a library's subclass) keeps its class and the
old behaviour.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from tiered.errors import ParameterNotGatheredError


class HookTarget(Protocol):
    """What the hooks dispatch to (tiered/zero/coordinator.py's `ZeroParameters`). A protocol,
    so that this module imports nothing of the coordinator's."""

    @property
    def busy(self) -> bool:
        """The coordinator is moving parameters itself: the mode must not gather on its ops."""
        ...

    @property
    def managed(self) -> Mapping[int, tuple[int, int]]:
        """id(parameter) -> (group index, entry index)."""
        ...

    def _forward_enter(self, module: nn.Module) -> None: ...

    def _forward_exit(self, module: nn.Module) -> None: ...

    def _backward_enter_cb(self, module: nn.Module) -> Callable[[], None]: ...

    def _leaf_boundary(self, module: nn.Module) -> Callable[..., tuple[torch.Tensor, ...]] | None: ...

    def _gather_external(self, p: nn.Parameter) -> None: ...

    def _grad_arriving(self, p: nn.Parameter) -> Callable[[torch.Tensor], None]: ...

    def _on_grad_ready(self, p: nn.Parameter) -> None: ...


class CallInBackward(torch.autograd.Function):
    """Identity on `tensors`; its backward calls `cb` once the gradients of all of them are
    computed, then passes them on. The one autograd function the engine adds: around a module's
    outputs its backward runs before the module's (re-gather, [Note: hooks that only dispatch]),
    around a leaf's inputs after the leaf's subtree's (flush, [Note: leaf modules])."""

    @staticmethod
    def forward(ctx: Any, cb: Callable[[], None], *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.cb = cb
        return tuple(t.detach() for t in tensors)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        with _no_torch_function():  # the gathers' own tensor calls, as in the forward hooks
            ctx.cb()
        return (None, *grads)


def map_tensors(obj: Any, fn: Callable[[list[torch.Tensor]], list[torch.Tensor]], module_name: str) -> Any:
    """Apply `fn` to every grad-requiring tensor found in `obj` (tuples, lists, dicts, HF
    ModelOutput, dataclasses, namedtuples), all at once, and rebuild `obj` around the results."""
    found: list[torch.Tensor] = []

    def collect(o: Any) -> None:
        if isinstance(o, torch.Tensor):
            if o.requires_grad:
                found.append(o)
        elif isinstance(o, (list, tuple)):
            for x in o:
                collect(x)
        elif isinstance(o, dict):
            for x in o.values():
                collect(x)
        elif dataclasses.is_dataclass(o) and not isinstance(o, type):
            for f in dataclasses.fields(o):
                collect(getattr(o, f.name))

    collect(obj)
    if not found:
        return obj
    out = iter(fn(found))

    def rebuild(o: Any) -> Any:
        if isinstance(o, torch.Tensor):
            return next(out) if o.requires_grad else o
        if isinstance(o, tuple) and hasattr(o, "_fields"):  # namedtuple
            return type(o)(*(rebuild(x) for x in o))
        if isinstance(o, (list, tuple)):
            return type(o)(rebuild(x) for x in o)
        if isinstance(o, dict):
            if type(o) is dict:
                return {k: rebuild(v) for k, v in o.items()}
            # OrderedDict / HF ModelOutput: assign in place so attribute views stay in sync
            for k in list(o.keys()):
                o[k] = rebuild(o[k])
            return o
        if dataclasses.is_dataclass(o) and not isinstance(o, type):
            for f in dataclasses.fields(o):
                v = getattr(o, f.name)
                nv = rebuild(v)
                if nv is not v:
                    object.__setattr__(o, f.name, nv)
            return o
        return o

    return rebuild(obj)


def _no_torch_function() -> Any:
    """Torch-function handling (our ExternalParamMode included) off for the enclosed calls."""
    return torch._C.DisableTorchFunction()


def _quiet(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` with torch-function handling off, for the gradient hooks' own tensor calls (each
    one a Python dispatch through `PartitionedParameter` otherwise)."""

    def run(*args: Any) -> Any:
        with _no_torch_function():
            return fn(*args)

    return run


class ExternalParamMode(TorchFunctionMode):
    """Gathers managed parameters used by an op while not gathered. See [Note: saved tensors and
    external parameters]."""

    def __init__(self, zp: HookTarget) -> None:
        super().__init__()
        self._zp = zp

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        zp = self._zp
        if not zp.busy:
            managed = zp.managed
            for a in args:
                if isinstance(a, nn.Parameter) and id(a) in managed and a.numel() == 0:
                    zp._gather_external(a)
                elif isinstance(a, (list, tuple)):
                    for b in a:
                        if isinstance(b, nn.Parameter) and id(b) in managed and b.numel() == 0:
                            zp._gather_external(b)
            if kwargs:
                for a in kwargs.values():
                    if isinstance(a, nn.Parameter) and id(a) in managed and a.numel() == 0:
                        zp._gather_external(a)
        return func(*args, **(kwargs or {}))


# What a released parameter still answers: metadata (property getters and setters arrive as
# `__get__` / `__set__`), hooks, printing and copying; every other op raises.
_METADATA = frozenset(
    {
        "__get__",
        "__set__",
        "__repr__",
        "__format__",
        "__reduce_ex__",
        "__deepcopy__",
        "__len__",
        "numel",
        "nelement",
        "dim",
        "ndimension",
        "size",
        "stride",
        "storage_offset",
        "element_size",
        "is_floating_point",
        "is_complex",
        "is_contiguous",
        "get_device",
        "data_ptr",
        "untyped_storage",
        "requires_grad_",
        "register_hook",
        "register_post_accumulate_grad_hook",
        "_has_compatible_shallow_copy_type",  # module.to()/_apply deciding how to swap, no values read
    }
)


# Properties whose value is a tensor of the parameter's own (absent) values: ``.data`` is handed
# out guarded (libraries read its shape and dtype); the views raise (the placeholder is 1-D, so
# ``.mT`` of it would fail with a misleading error). ``.grad`` is not one: it has its own buffer.
_DATA_ATTR = torch._C.TensorBase.__dict__["data"]
_VIEW_ATTRS = frozenset(torch._C.TensorBase.__dict__[n] for n in ("T", "mT", "H", "mH", "real", "imag"))
_VALUE_ATTRS = _VIEW_ATTRS | {_DATA_ATTR}


def _not_gathered(name: str, func: Any) -> ParameterNotGatheredError:
    op = getattr(func, "__name__", str(func))
    if op in ("__get__", "__set__"):
        op = f"{op} of {getattr(getattr(func, '__self__', None), '__name__', '?')}"
    return ParameterNotGatheredError(
        f"parameter {name!r} is partitioned by tiered's ZeRO-3 engine and holds no values outside "
        f"forward ({op} would see an empty tensor): read it inside `with engine.gathered_parameters("
        "module_or_params):`, export with `engine.save_pretrained(dir)` (not the model's own "
        "save_pretrained / state_dict), or call `engine.close()` to get ordinary parameters back"
    )


# What ReleasedData refuses although a parameter answers it: copying and pickling read the values,
# and a storage pointer is how writers (safetensors, transformers' save_pretrained) reach them.
_VALUE_READING_METADATA = frozenset({"__deepcopy__", "__reduce_ex__", "untyped_storage", "data_ptr"})


class ReleasedData(torch.Tensor):
    """The empty tensor a released parameter's ``.data`` (or ``.T``, ...) hands out: metadata
    reads as the placeholder's, every other op raises. See [Note: partitioned parameters outside
    forward]."""

    _tiered_name: str = "?"

    @staticmethod
    def guard(t: torch.Tensor, name: str) -> ReleasedData:
        out = t.as_subclass(ReleasedData)
        out._tiered_name = name
        return out

    @classmethod
    def __torch_function__(
        cls, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        with torch._C.DisableTorchFunctionSubclass():
            name = getattr(func, "__name__", None)
            if name == "__get__":
                attr = getattr(func, "__self__", None)
                if attr is _DATA_ATTR:
                    return args[0]  # .data of the absent values: themselves
                if attr in _VIEW_ATTRS:
                    raise _not_gathered(args[0]._tiered_name, func)
                return func(*args)
            if name == "to" and args and type(args[0]) is cls:
                out = func(*args, **(kwargs or {}))
                if out.device == args[0].device and out.dtype == args[0].dtype:
                    return out  # a move that changes nothing (module.to, accelerate)
                raise _not_gathered(args[0]._tiered_name, func)
            if name in _METADATA and name not in _VALUE_READING_METADATA:
                return func(*args, **(kwargs or {}))
            for a in (*args, *(kwargs or {}).values()):
                for b in a if isinstance(a, (list, tuple)) else (a,):
                    if type(b) is cls:
                        raise _not_gathered(b._tiered_name, func)
            return func(*args, **(kwargs or {}))


class PartitionedParameter(nn.Parameter):
    """A managed parameter while the hooks are installed. See [Note: partitioned parameters
    outside forward]. Subclassed per model (`for_model`) with its names and element counts."""

    _names: Mapping[int, str] = {}
    _numel: Mapping[int, int] = {}
    _shape: Mapping[int, torch.Size] = {}

    @classmethod
    def for_model(
        cls, names: Mapping[int, str], numel: Mapping[int, int], shape: Mapping[int, torch.Size] | None = None
    ) -> type[PartitionedParameter]:
        return type("PartitionedParameter", (cls,), {"_names": names, "_numel": numel, "_shape": shape or {}})

    @classmethod
    def __torch_function__(
        cls, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        with torch._C.DisableTorchFunctionSubclass():  # as nn.Parameter's own (disabled) handler
            name = getattr(func, "__name__", None)
            if name == "__get__":
                attr = getattr(func, "__self__", None)
                if attr in _VALUE_ATTRS and cls._released(args[0]):
                    if attr is not _DATA_ATTR:
                        cls._check(args[0], func)
                    return ReleasedData.guard(func(*args), cls._names.get(id(args[0]), "?"))
                return func(*args)
            if name == "detach" and args and cls._released(args[0]):
                # a module's state_dict() detaches each parameter: DeepSpeed's ZeRO-3 hands out the
                # empty placeholders there, so does this, guarded (their values, their storage and
                # saving them raise)
                return ReleasedData.guard(func(*args, **(kwargs or {})), cls._names.get(id(args[0]), "?"))
            if name == "to" and args and type(args[0]) is cls:
                # module.to(device) (accelerate, Trainer) on a released parameter: a move that
                # changes nothing is allowed; one that would copy its (absent) values is not
                out = func(*args, **(kwargs or {}))
                if out.device == args[0].device and out.dtype == args[0].dtype:
                    return out
                cls._check(args[0], func)
                return out
            if name not in _METADATA:
                for a in args:
                    if isinstance(a, (list, tuple)):
                        for b in a:
                            cls._check(b, func)
                    else:
                        cls._check(a, func)
                if kwargs:
                    for a in kwargs.values():
                        cls._check(a, func)
            return func(*args, **(kwargs or {}))

    @property
    def ds_numel(self) -> int:
        """The full element count, also while released (DeepSpeed's attribute of the same name,
        which peft's ``print_trainable_parameters`` and other ZeRO-3-aware tools read where
        ``numel()`` is 0)."""
        return self._numel.get(id(self), 0) or self.numel()

    @property
    def ds_shape(self) -> torch.Size:
        """The full shape, also while released (DeepSpeed's attribute)."""
        return self._shape.get(id(self)) or self.shape

    @property
    def ds_tensor(self) -> torch.Tensor:
        """DeepSpeed's handle on this rank's partition, as scripts use it: ``hasattr(p,
        "ds_tensor")`` says the parameter is partitioned (so ``ds_numel`` counts it) and its
        numel is the partition's, ceil(ds_numel / world size) as DeepSpeed pads it. A meta
        tensor: the values live in tiered's tiers (safe_get_local_fp32_param reads them)."""
        world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        return torch.empty(-(-self.ds_numel // world), dtype=self.dtype, device="meta")

    @classmethod
    def _released(cls, a: Any) -> bool:
        return type(a) is cls and a.numel() == 0 and cls._numel.get(id(a), 0) > 0

    @classmethod
    def _check(cls, a: Any, func: Any) -> None:
        if cls._released(a):
            raise _not_gathered(cls._names.get(id(a), "?"), func)


class HookSet:
    """The handles of every hook installed on a model; `remove()` takes them all off."""

    def __init__(
        self,
        zp: HookTarget,
        model: nn.Module,
        params: list[nn.Parameter],
        sizes: list[int],
        shapes: list[tuple[int, ...]] | None = None,
    ) -> None:
        self._handles: list[Any] = []
        for name, module in model.named_modules():
            self._handles.append(
                module.register_forward_pre_hook(self._make_pre(zp, module, name), with_kwargs=True)
            )
            self._handles.append(
                module.register_forward_hook(
                    self._make_post(zp, module, name), with_kwargs=True, always_call=True
                )
            )
        for p in params:
            if p.requires_grad:
                # AccumulateGrad lays the gradient out like the parameter's current data, so the
                # parameter must be gathered when its gradient arrives (a tied or external weight
                # whose last use was in another module): gather on demand before, flush after.
                self._handles.append(p.register_hook(_quiet(zp._grad_arriving(p))))
                self._handles.append(p.register_post_accumulate_grad_hook(_quiet(zp._on_grad_ready)))
        names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
        self._switched = [p for p in params if type(p) is nn.Parameter]
        cls = PartitionedParameter.for_model(
            names,
            {id(p): numel for p, numel in zip(params, sizes, strict=True)},
            {id(p): torch.Size(s) for p, s in zip(params, shapes or [], strict=False)},
        )
        for p in self._switched:
            p.__class__ = cls  # [Note: partitioned parameters outside forward]

    # The hooks' own tensor calls (p.data = ..., views, numel) run outside ExternalParamMode:
    # through it every one of them became a Python dispatch, which tripled the hooks' cost
    # (measured on benchmarks/step.py: ~50 ms of a ~1 s step).
    @staticmethod
    def _make_pre(zp: HookTarget, module: nn.Module, name: str) -> Callable[..., Any]:
        boundary = zp._leaf_boundary(module)  # a leaf's inputs: see [Note: leaf modules]

        def pre(mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            with _no_torch_function():
                zp._forward_enter(module)
                if boundary is None or not torch.is_grad_enabled():
                    return None
                return map_tensors((args, kwargs), lambda ts: list(boundary(*ts)), name)

        return pre

    @staticmethod
    def _make_post(zp: HookTarget, module: nn.Module, name: str) -> Callable[..., Any]:
        def post(mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> Any:
            with _no_torch_function():
                zp._forward_exit(module)
                if not torch.is_grad_enabled():
                    return None
                cb = zp._backward_enter_cb(module)
                return map_tensors(output, lambda ts: list(CallInBackward.apply(cb, *ts)), name)

        return post

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        for p in self._switched:
            p.__class__ = nn.Parameter
        self._switched.clear()
