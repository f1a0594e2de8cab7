"""Logits-processor plug-ins named on the command line (``--logits-processors module:Class``):
their names checked and their classes loaded by name. It lives with the options, below the
sampler (pagoda/sample/logits_processor.py, which defines ``LogitsProcessor`` and re-exports
these), so a class is recognised as a LogitsProcessor by its bases' qualified names."""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Sequence
from typing import Any

_BASE = "pagoda.sample.logits_processor:LogitsProcessor"



def processor_name(spec: Any) -> str:
    """A ``--logits-processors`` entry as the name the engine loads it by: "module:Class" and
    "module.Class" (a fully qualified name) as given, a class as "module:Qualname". A class
    must be reachable by that name (defined at a module's top level): the engine core may
    run in another process, which imports it there. ValueError otherwise."""
    if isinstance(spec, str):
        spec = spec.strip()
        module, qualname = _split(spec)
        if not module or not qualname:
            raise ValueError(f"logits_processors: {spec!r} is not a class name: give module:Class or "
                             "module.Class (the module importable where the engine runs)")
        return spec
    if inspect.isclass(spec):
        name = f"{spec.__module__}:{spec.__qualname__}"
        if "<locals>" in spec.__qualname__ or _resolve(name) is not spec:
            raise ValueError(f"logits_processors: {spec.__qualname__} cannot be loaded by its name {name!r} (a "
                             "class defined inside a function, or replaced since): the engine core loads "
                             "processors by name, in its own process; define it at the top level of a module")
        return name
    raise ValueError(f"logits_processors: entries are class names (module:Class) or LogitsProcessor subclasses, "
                     f"got {spec!r}")


def _split(name: str) -> tuple[str, str]:
    """(module, qualified name in it) of "module:Qualname" or "module.Name"."""
    module, _, qualname = name.partition(":") if ":" in name else name.rpartition(".")
    return module, qualname


def _attribute(module: Any, qualname: str) -> Any:
    for attr in qualname.split("."):
        module = getattr(module, attr)
    return module


def _resolve(name: str) -> Any:
    module, qualname = _split(name)
    return _attribute(importlib.import_module(module), qualname)


def load_processor_class(name: str) -> type:
    """The LogitsProcessor subclass a name (``processor_name``'s form) names; ValueError
    saying what is wrong (the module does not import, it has no such attribute, that is not
    a concrete LogitsProcessor subclass)."""
    module_name, qualname = _split(name)
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        raise ValueError(f"logits_processors: {name!r}: no module named {e.name!r} (is it on the Python path "
                         f"of the engine's process?)") from None
    except Exception as e:   # the module raised while importing
        raise ValueError(f"logits_processors: {name!r}: importing {module_name!r} failed: "
                         f"{type(e).__name__}: {e}") from None
    try:
        cls = _attribute(module, qualname)
    except AttributeError:
        raise ValueError(f"logits_processors: {name!r}: module {module_name!r} has no {qualname!r}") from None
    if not inspect.isclass(cls) or not any(f"{base.__module__}:{base.__qualname__}" == _BASE for base in cls.__mro__):
        raise ValueError(f"logits_processors: {name!r} is not a subclass of "
                         f"pagoda.sample.logits_processor.LogitsProcessor")
    if inspect.isabstract(cls):
        missing = ", ".join(sorted(cls.__abstractmethods__))
        raise ValueError(f"logits_processors: {name!r} is abstract: it does not implement {missing}")
    return cls


def resolve_processor_names(specs: Sequence[Any] | str | None) -> tuple[str, ...]:
    """The option's value as names, each loaded once to check it (ValueError naming the bad
    one): what ``EngineConfig`` keeps, so the option travels between processes as text."""
    if specs is None:
        return ()
    if isinstance(specs, str) or inspect.isclass(specs):
        specs = [specs]
    names = [processor_name(s) for s in specs]
    for name in names:
        load_processor_class(name)
    classes = [_resolve(n) for n in names]
    for i, cls in enumerate(classes):
        if cls in classes[:i]:
            raise ValueError(f"logits_processors: {names[i]!r} is listed twice")
    return tuple(names)
