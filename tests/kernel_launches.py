"""Every kind of Triton kernel launch the interpreter tests make, recorded
for ``tests/models/test_kernels_compile.py``, which compiles each for an
H200 without one: Triton's interpreter runs a kernel's Python, not the
compiler's front end, which refuses more (a loop-carried name that changes
type, a branch whose variables differ).

A kind is the kernel, its arguments' types and its boolean, string and
absent constant arguments (the branches it takes); its integer constants
(block sizes) are the first launch's. ``install`` wraps the interpreter's
launch once, from ``conftest.py``, only where the interpreter runs."""

from __future__ import annotations

import inspect

# kind -> {"module", "name", "signature": {arg: type or "constexpr"}, "constants": {arg: value}, "num_warps"}
LAUNCHES: dict[tuple, dict] = {}
# Launches whose arguments have no compiled equivalent here (a tensor descriptor, a dtype as a constant): their count.
UNRECORDED: dict[str, int] = {}

_TYPES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "int64": "i64", "int32": "i32", "int16": "i16",
          "int8": "i8", "uint8": "u8", "bool": "i1", "float64": "fp64"}


def _arg_type(value) -> str | None:
    """The compiler's name for a runtime argument's type, None where there is none here."""
    if hasattr(value, "data_ptr") and hasattr(value, "dtype"):
        name = _TYPES.get(str(value.dtype).removeprefix("torch."))
        return None if name is None else f"*{name}"
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -(2**31) <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    return None


def record(kernel, args: tuple, kwargs: dict) -> None:
    fn = kernel.fn
    if not fn.__module__.startswith("mstar_actors."):  # a test's own kernel (a reference), not the engine's
        return
    params = list(inspect.signature(fn).parameters.values())
    constexprs = {p.name for p in params if "constexpr" in str(p.annotation)}
    bound = dict(zip([p.name for p in params], args))
    bound.update({k: v for k, v in kwargs.items() if k in {p.name for p in params}})
    for p in params:  # defaults the launch left out
        if p.name not in bound and p.default is not inspect.Parameter.empty:
            bound[p.name] = p.default
    signature, constants = {}, {}
    for name, value in bound.items():
        if name in constexprs or value is None:
            value = getattr(value, "value", value)  # a tl.constexpr default
            if value is not None and not isinstance(value, (bool, int, float, str)):
                UNRECORDED[fn.__name__] = UNRECORDED.get(fn.__name__, 0) + 1
                return
            signature[name], constants[name] = "constexpr", value
        else:
            kind = _arg_type(value)
            if kind is None:
                UNRECORDED[fn.__name__] = UNRECORDED.get(fn.__name__, 0) + 1
                return
            signature[name] = kind
    branches = tuple(sorted((k, v) for k, v in constants.items() if v is None or isinstance(v, (bool, str))))
    key = (fn.__module__, fn.__qualname__, tuple(signature.items()), branches)
    LAUNCHES.setdefault(key, {"module": fn.__module__, "name": fn.__qualname__, "signature": signature,
                              "constants": constants, "num_warps": kwargs.get("num_warps", 4)})


def install() -> None:
    """Record every launch through Triton's interpreter from now on (once)."""
    from triton.runtime.interpreter import InterpretedFunction

    if getattr(InterpretedFunction.run, "records_launches", False):
        return
    launch = InterpretedFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        record(self, args, kwargs)
        return launch(self, *args, grid=grid, warmup=warmup, **kwargs)

    run.records_launches = True
    InterpretedFunction.run = run
