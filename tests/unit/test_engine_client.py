"""EngineClient (pagoda/engine/client.py): the three engines implement all of it, and the HTTP
server depends on it alone, never probing the engine for what it might have."""

from __future__ import annotations

import ast
import asyncio
import inspect
import textwrap
from pathlib import Path

import pytest

from pagoda.engine.async_llm import AsyncLLM
from pagoda.engine.client import EngineClient
from pagoda.engine.dp_client import DataParallelLLM
from pagoda.sampling_params import SamplingParams
from pagoda.validation import InvalidRequestError
from tests.e2e.fake_engine import FakeEngine

ROOT = Path(__file__).resolve().parents[2]
ENGINES = [AsyncLLM, DataParallelLLM, FakeEngine]


def _protocol_members() -> tuple[set[str], set[str]]:
    """(data attributes, methods and properties) that EngineClient declares."""
    data = {name for name in EngineClient.__annotations__ if not name.startswith("_")}
    callables = {name for name in vars(EngineClient) if not name.startswith("_")}
    return data, callables - data


def _defining_class(cls: type, name: str) -> type:
    return next(k for k in cls.__mro__ if name in vars(k))


def _assigns(cls: type, name: str) -> bool:
    """Whether some __init__ in cls's MRO assigns ``self.<name>``."""
    for k in cls.__mro__:
        init = vars(k).get("__init__")
        if init is None or k is object:
            continue
        for node in ast.walk(ast.parse(textwrap.dedent(inspect.getsource(init)))):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] \
                if isinstance(node, ast.AnnAssign) else []
            if any(isinstance(t, ast.Attribute) and t.attr == name and isinstance(t.value, ast.Name)
                   and t.value.id == "self" for t in targets):
                return True
    return False


def _compatible(proto: inspect.Signature, impl: inspect.Signature) -> str | None:
    """Why ``impl`` cannot stand in for ``proto`` (None if it can): the protocol's parameters
    in order with the same names, kinds and defaults; any extra ones optional."""
    p, i = list(proto.parameters.values()), list(impl.parameters.values())
    if len(i) < len(p):
        return f"missing parameters {[x.name for x in p[len(i):]]}"
    for a, b in zip(p, i):
        if (a.name, a.kind, a.default) != (b.name, b.kind, b.default):
            return f"parameter {b} where the protocol has {a}"
    extra = [x.name for x in i[len(p):] if x.default is inspect.Parameter.empty
             and x.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)]
    return f"extra required parameters {extra}" if extra else None


def test_the_protocol_lists_what_the_server_uses():
    data, callables = _protocol_members()
    assert {"config", "tokenizer", "max_model_len", "vocab_size", "lora_requests"} <= data
    assert {"validate_request", "generate", "abort", "add_lora", "remove_lora", "is_healthy", "dead_reason",
            "degraded_reason", "latest_stats", "check_integrity", "ensure_background_tasks",
            "shutdown"} <= callables  # fmt: skip


@pytest.mark.parametrize("cls", ENGINES, ids=lambda c: c.__name__)
def test_engine_implements_the_protocol(cls: type) -> None:
    assert EngineClient in cls.__mro__  # subclassed explicitly, not by accident of shape
    data, callables = _protocol_members()
    problems = []
    for name in sorted(callables):
        owner = _defining_class(cls, name)
        if owner is EngineClient:
            problems.append(f"{name}: not implemented (only the protocol's stub)")
            continue
        proto, impl = vars(EngineClient)[name], vars(owner)[name]
        if isinstance(proto, property):
            if not isinstance(impl, property):
                problems.append(f"{name}: a property in the protocol, {type(impl).__name__} here")
            continue
        if inspect.iscoroutinefunction(proto) and not inspect.iscoroutinefunction(impl):
            problems.append(f"{name}: must be async")
        if name == "generate" and not inspect.isasyncgenfunction(impl):
            problems.append("generate: must be an async generator")
        why = _compatible(inspect.signature(proto), inspect.signature(impl))
        if why:
            problems.append(f"{name}: {why}")
    for name in sorted(data):
        if not _assigns(cls, name):
            problems.append(f"{name}: no __init__ in the class's MRO sets self.{name}")
    assert not problems, f"{cls.__name__} vs EngineClient:\n" + "\n".join(problems)


def test_a_fake_engine_instance_is_an_engine_client():
    engine = FakeEngine()
    assert isinstance(engine, EngineClient)
    assert engine.lora_requests == {} and engine.dead_reason is None and engine.degraded_reason is None


def test_generate_validates_before_it_streams():
    """generate() is EngineClientBase's: the one check (pagoda/validation.py), then the stream."""
    engine = FakeEngine(max_model_len=16)

    async def run(ids: list[int], **kw) -> list:
        return [out async for out in engine.generate("r", None, ids, SamplingParams(max_tokens=2), **kw)]

    with pytest.raises(InvalidRequestError, match="max_model_len") as info:
        asyncio.run(run(list(range(16))))
    assert info.value.code == "context_length_exceeded" and info.value.param == "prompt"
    with pytest.raises(InvalidRequestError, match="fcfs"):
        asyncio.run(run([1, 2], priority=1))
    assert engine.calls == []
    outs = asyncio.run(run([1, 2]))
    assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 2 and engine.finished == ["r"]


def _engine_probes(path: Path, root: Path = ROOT) -> list[str]:
    """getattr()/hasattr() calls whose object is an engine (a name or attribute called ``engine``)."""
    source = path.read_text()
    found = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id in ("getattr", "hasattr") and node.args):
            continue
        target = node.args[0]
        names = {n.id for n in ast.walk(target) if isinstance(n, ast.Name)} | \
                {n.attr for n in ast.walk(target) if isinstance(n, ast.Attribute)}
        if any("engine" in name for name in names):
            found.append(f"{path.relative_to(root)}:{node.lineno}: {ast.get_source_segment(source, node)}")
    return found


def test_entrypoints_never_probe_the_engine():
    probes = [p for path in sorted((ROOT / "pagoda" / "entrypoints").rglob("*.py")) for p in _engine_probes(path)]
    assert not probes, "the server uses EngineClient's members, it does not probe for them:\n" + "\n".join(probes)


def test_the_probe_finder_finds_probes(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("a = getattr(engine, 'x', None)\nb = hasattr(self.engine, 'y')\nc = getattr(args, 'engine')\n")
    assert _engine_probes(f, tmp_path) == ["m.py:1: getattr(engine, 'x', None)", "m.py:2: hasattr(self.engine, 'y')"]
