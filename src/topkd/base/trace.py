"""Op traces: every aten op a piece of code issues, with its FLOPs, bytes moved and the memory it holds.

    with OpTrace() as trace:
        topkd.fused_linear_kd(x, w, ids, logprobs).backward()   # real tensors, or meta ones (shapes only)
    trace.ops           # [Op(name, kind, flops, read, written, elements)], in issue order
    trace.peak_bytes    # most bytes alive at once in storages created under the trace

The cost model (topkd.bench.model) turns a trace into a predicted time. Byte counts are what an op
must move at least: a GEMM reads its operands and writes its output (and reads the accumulator unless
beta = 0); a gather reads only the picked elements; an in-place scatter writes only its [C, K] values.
Views, allocations and scalar reads move nothing. Kernels that bypass the dispatcher (Triton) call
`declare(...)` with their own traffic; on meta tensors they are then not launched (see `tracing_meta`).
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

# name -> positions of the two mats
GEMMS = {"mm": (0, 1), "addmm": (1, 2), "bmm": (0, 1), "baddbmm": (1, 2)}
TRANSCENDENTAL = {
    "exp",
    "exp_",
    "log",
    "log_",
    "_log_softmax",
    "_softmax",
    "_log_softmax_backward_data",
    "_softmax_backward_data",
    "tanh",
    "tanh_",
    "sigmoid",
    "pow",
    "log1p",
    "expm1",
    "logsumexp",
}
REDUCTIONS = {
    "sum",
    "amax",
    "amin",
    "max",
    "min",
    "mean",
    "logsumexp",
    "any",
    "all",
    "nonzero",
    "argmax",
}
# read the picked elements, not the source
PICKS = {"gather", "index_select", "take_along_dim", "index"}
# write (and read) only the put elements
PUTS = {
    "scatter",
    "scatter_",
    "scatter_add",
    "scatter_add_",
    "index_put",
    "index_put_",
    "_index_put_impl_",
    "index_copy",
    "index_copy_",
    "index_add_",
    "index_add",
}
FREE = {
    "empty",
    "empty_like",
    "empty_strided",
    "new_empty",
    "new_empty_strided",
    "_local_scalar_dense",
    "is_same_size",
    "lift_fresh",
    "resize_",
    "set_",
    "_to_copy_meta",
}


@dataclass
class Op:
    name: str
    kind: str  # gemm | transcendental | reduction | index | copy | elementwise | kernel | alloc
    flops: int
    read: int  # bytes
    written: int  # bytes
    elements: int  # elements an elementwise engine processes
    dtype: str  # a GEMM's input dtype (its rate), else its output's
    shape: tuple = ()  # a GEMM's (mm | addmm | ..., m, k, n, dtype)
    fresh: int = 0  # bytes of new storages it allocated (page faults on a CPU)


def _bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _tensors(tree) -> list[torch.Tensor]:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


def describe(func, args: tuple, kwargs: dict, out) -> Op | None:
    """The Op record of one aten call, or None for views and allocations (no data moved)."""
    name = func.overloadpacket.__name__
    if func.is_view or name in FREE:
        return None
    outs, ins = _tensors(out), _tensors((args, {k: v for k, v in kwargs.items() if k != "out"}))
    written, read = sum(map(_bytes, outs)), sum(map(_bytes, ins))
    elements = max([t.numel() for t in ins + outs] or [0])
    dtype = str((outs or ins or [torch.empty(0)])[0].dtype).replace("torch.", "")
    base = name.rstrip("_")
    if base in GEMMS:
        return _gemm_op(name, base, args, kwargs, read, written, elements)
    if base in PICKS:
        index_bytes = sum(_bytes(t) for t in ins[1:] if not t.is_floating_point())
        return Op(
            name, "index", 0, index_bytes + written, written, max(t.numel() for t in outs), dtype
        )
    if base in PUTS:
        return _put_op(name, ins, dtype)
    if name in ("copy_", "fill_", "zero_", "_copy_from", "_to_copy", "clone", "copy"):
        src = read - (_bytes(args[0]) if name in ("copy_", "fill_", "zero_") else 0)
        return Op(name, "copy", 0, max(src, 0), written, elements, dtype)
    if base in TRANSCENDENTAL:
        return Op(name, "transcendental", 0, read, written, elements, dtype)
    if base in REDUCTIONS:
        return Op(name, "reduction", 0, read, written, elements, dtype)
    return Op(name, "elementwise", 0, read, written, elements, dtype)


def _gemm_op(
    name: str, base: str, args: tuple, kwargs: dict, read: int, written: int, elements: int
) -> Op:
    """A GEMM: 2 M K N flops at its inputs' rate, whatever it writes; with beta = 0 the accumulator is overwritten,
    never read."""
    a, b = (args[i] for i in GEMMS[base])
    if base in ("addmm", "baddbmm") and kwargs.get("beta", 1) == 0:
        read -= _bytes(args[0])
    rate_dtype = str(a.dtype).replace("torch.", "")
    shape_key = (base, a.shape[-2], a.shape[-1], b.shape[-1], rate_dtype)
    return Op(
        name, "gemm", 2 * a.numel() * b.shape[-1], read, written, elements, rate_dtype, shape_key
    )


def _put_op(name: str, ins: list, dtype: str) -> Op:
    """A scatter / index_put: index and values (or src) are [C, K], so only those elements of self are touched;
    out of place, self is copied first."""
    moved = ins[1:]
    size = max((t.numel() for t in moved), default=0)
    touched = size * ins[0].element_size()
    copy = 0 if name.endswith("_") else _bytes(ins[0])
    return Op(
        name, "index", 0, sum(map(_bytes, moved)) + touched + copy, touched + copy, size, dtype
    )


def _call(func, args: tuple, kwargs: dict):
    """func(*args, **kwargs), standing in for meta kernels that some torch versions lack: torch 2.11's meta
    addmm with out_dtype passes out_dtype where beta goes (TypeError). A meta op computes only a shape, so
    its output (the out= tensor, or an empty one of the result's shape) is what it would return; the op is
    still recorded from its own arguments (beta, operands), so the trace counts the same bytes."""
    try:
        return func(*args, **kwargs)
    except TypeError:
        if (
            func.overloadpacket.__name__ != "addmm"
            or func._overloadname not in ("dtype", "dtype_out")
            or args[1].device.type != "meta"
        ):
            raise
        if "out" in kwargs:
            return kwargs["out"]
        # args[3]: out_dtype
        return torch.empty(args[1].shape[0], args[2].shape[1], dtype=args[3], device="meta")


_ACTIVE = threading.local()


def active() -> "OpTrace | None":
    """The innermost OpTrace on this thread, or None."""
    stack = getattr(_ACTIVE, "stack", [])
    return stack[-1] if stack else None


def declare(name: str, read: int, written: int, elements: int, dtype: str = "float32") -> None:
    """A kernel the dispatcher never sees (Triton) reports its traffic to the active trace."""
    trace = active()
    if trace is not None:
        trace.ops.append(Op(name, "kernel", 0, read, written, elements, dtype))


def tracing_meta(t: torch.Tensor) -> bool:
    """True when t is a meta tensor under a trace: a declared kernel records itself and is not launched."""
    return t.device.type == "meta" and active() is not None


class OpTrace(TorchDispatchMode):
    """Records an Op per aten call and the peak of live bytes in storages created under it."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[Op] = []
        self.live_bytes = self.peak_bytes = 0
        self._seen: set[int] = set()

    def __enter__(self):
        _ACTIVE.stack = getattr(_ACTIVE, "stack", []) + [self]
        return super().__enter__()

    def __exit__(self, *exc):
        _ACTIVE.stack = _ACTIVE.stack[:-1]
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = _call(func, args, kwargs)
        op = describe(func, args, kwargs, out)
        fresh = 0
        if not func.is_view and not func._schema.is_mutable:  # fresh outputs: new storages
            fresh = sum(self._hold(t.untyped_storage()) for t in _tensors(out))
        if op is not None:
            op.fresh = fresh
            self.ops.append(op)
        elif fresh:  # an empty(): its pages fault on use
            self.ops.append(Op(func.overloadpacket.__name__, "alloc", 0, 0, 0, 0, "", (), fresh))
        return out

    def _hold(self, storage) -> int:
        """Count a storage as live until it is freed; returns its bytes if it is new."""
        key = id(storage)
        if key in self._seen:
            return 0
        self._seen.add(key)
        size = storage.nbytes()
        self.live_bytes += size
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        weakref.finalize(storage, self._release, key, size)
        return size

    def _release(self, key: int, size: int) -> None:
        self._seen.discard(key)
        self.live_bytes -= size

    def totals(self) -> dict:
        return {
            "ops": len(self.ops),
            "flops": sum(o.flops for o in self.ops),
            "bytes": sum(o.read + o.written for o in self.ops),
            "peak_bytes": self.peak_bytes,
        }
