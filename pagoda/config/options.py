"""Options defined once.

An engine option is one dataclass field made with ``option(...)``: its default, its help,
its choices, how the command line spells and parses it, and which commands take it. From
those fields come the command line's argument groups (``add_option_groups``), the
``PAGODA_*`` environment variables and ``--config FILE.yaml`` (``apply_environment``,
``apply_config_file``: both work on a command's parser, so the server's own flags take
them too) and the options reference, docs/configuration.md (``reference_markdown``).

Precedence, highest first: the command line, then ``PAGODA_<OPTION>`` variables, then the
``--config`` file, then the option's default.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

ENV_PREFIX = "PAGODA_"
_TRUE, _FALSE = {"1", "true", "yes", "on"}, {"0", "false", "no", "off", ""}


@dataclass(frozen=True)
class OptionSpec:
    """What one field says about itself beyond its type and default."""

    help: str
    aliases: tuple[str, ...] = ()             # other spellings on the command line (-tp)
    choices: tuple[Any, ...] | None = None    # accepted values (None: any of its type)
    parse: Callable[[str], Any] | None = None  # the command line's converter (None: from the type)
    metavar: str | None = None
    cli: bool = True                          # False: set from Python only (or internally)
    commands: tuple[str, ...] | None = None   # only these commands take it (None: every engine command)
    default_text: str | None = None           # the default in words, where it is resolved later
    nargs: str | None = None                  # "+": a list on the command line (--flag a b c)


def option(default: Any, help: str, **spec: Any) -> Any:
    """A dataclass field that is an engine option (see ``OptionSpec`` for ``spec``)."""
    return dataclasses.field(default=default, metadata={"option": OptionSpec(help=help, **spec)})


class OptionGroup:
    """A typed group of options (a frozen dataclass deriving from this): it checks its own
    fields in ``check``; what concerns two groups is the engine's (pagoda/config/engine.py)."""

    TITLE: ClassVar[str] = ""
    DESCRIPTION: ClassVar[str] = ""

    def check(self) -> None:
        """Raise ValueError naming the option when a value of this group is out of bounds."""

    def __post_init__(self) -> None:
        type(self).check(self)


@dataclass(frozen=True)
class Option:
    """One option as the tools see it: its group, field name, default, type and spec."""

    group: type[OptionGroup]
    name: str
    default: Any
    type: Any
    spec: OptionSpec

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.name.upper()

    @property
    def is_switch(self) -> bool:
        return _base_type(self.type) is bool

    def takes(self, command: str | None) -> bool:
        return self.spec.cli and (self.spec.commands is None or command in self.spec.commands)


def _base_type(hint: Any) -> Any:
    """``int | None`` -> int; a union of several types (``X | dict | str``) -> str."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return args[0] if len(args) == 1 else str
    return hint


def options_of(group: type[OptionGroup]) -> list[Option]:
    """The options a group declares, in their order."""
    hints = typing.get_type_hints(group)
    found = []
    for f in dataclasses.fields(group):  # type: ignore[arg-type]
        spec = f.metadata.get("option")
        if spec is not None:
            found.append(Option(group, f.name, f.default, hints[f.name], spec))
    return found


def _default_words(opt: Option) -> str | None:
    if opt.spec.default_text is not None:
        return opt.spec.default_text
    if opt.default is None or opt.default is False:
        return None
    return str(opt.default)


def _argparse_help(opt: Option) -> str:
    words = _default_words(opt)
    text = opt.spec.help + (f" (default: {words})" if words is not None and "default" not in opt.spec.help else "")
    return text.replace("%", "%%")


def add_option_groups(parser: argparse.ArgumentParser, groups: Iterable[type[OptionGroup]],
                      command: str | None, positional: Iterable[str] = ()) -> dict[str, argparse._ArgumentGroup]:
    """Each group's options that ``command`` takes as one argument group of ``parser``;
    the options named in ``positional`` as optional positional arguments. Returns the
    argument groups by their group's class name (for flags that are spellings of options)."""
    positional = set(positional)
    made = {}
    for group in groups:
        opts = [o for o in options_of(group) if o.takes(command)]
        if not opts:
            continue
        arg_group = parser.add_argument_group(group.TITLE, group.DESCRIPTION or None)
        made[group.__name__] = arg_group
        for opt in opts:
            kwargs: dict[str, Any] = {"default": opt.default, "help": _argparse_help(opt)}
            if opt.is_switch:
                kwargs["action"] = argparse.BooleanOptionalAction
            else:
                kwargs["type"] = opt.spec.parse or _base_type(opt.type)
                if kwargs["type"] not in (int, float) and not callable(opt.spec.parse):
                    kwargs["type"] = str
                if opt.spec.choices is not None:
                    kwargs["choices"] = opt.spec.choices
                if opt.spec.metavar is not None:
                    kwargs["metavar"] = opt.spec.metavar
                if opt.spec.nargs is not None:
                    kwargs["nargs"] = opt.spec.nargs
            if opt.name in positional:
                kwargs.pop("action", None)
                arg_group.add_argument(opt.name, nargs="?", **kwargs)
            else:
                arg_group.add_argument(opt.flag, *opt.spec.aliases, dest=opt.name, **kwargs)
    return made


def option_values(args: argparse.Namespace, groups: Iterable[type[OptionGroup]]) -> dict[str, Any]:
    """The options of ``groups`` that ``args`` holds, by field name."""
    return {o.name: getattr(args, o.name) for g in groups for o in options_of(g) if hasattr(args, o.name)}


# --- environment variables and --config files, on any command's parser ---------------------

def _settable(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {a.dest: a for a in parser._actions
            if a.dest not in (None, argparse.SUPPRESS, "help", "config") and not isinstance(a, argparse._HelpAction)}


def _is_switch(action: argparse.Action) -> bool:
    return isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction, argparse.BooleanOptionalAction))


def _convert(action: argparse.Action, value: Any) -> Any:
    """A value from the environment (a string) or a file (YAML's own types) as the flag
    would take it from the command line; ArgumentTypeError / ValueError when it would not."""
    if _is_switch(action):
        if isinstance(value, bool):
            return value
        text = str(value).strip().lower()
        if text not in _TRUE | _FALSE:
            raise argparse.ArgumentTypeError(f"expected 1/true/yes/on or 0/false/no/off, got {value!r}")
        return text in _TRUE
    if action.nargs in ("+", "*"):
        items = value.split() if isinstance(value, str) else value
        if not isinstance(items, list):
            raise argparse.ArgumentTypeError(f"expected a list, got {value!r}")
        return [_one(action, item) for item in items]
    return _one(action, value)


def _one(action: argparse.Action, value: Any) -> Any:
    if isinstance(value, (dict, list)):
        import json

        value = json.dumps(value)   # a JSON option written as YAML
    if callable(action.type) and not (action.type in (int, float) and type(value) is action.type):
        value = action.type(str(value))
    elif action.type is None:
        value = str(value)
    if action.choices is not None and value not in action.choices:
        raise argparse.ArgumentTypeError(f"{value!r} is not one of {', '.join(map(str, action.choices))}")
    return value


def apply_environment(parser: argparse.ArgumentParser, environ: Mapping[str, str]) -> None:
    """``PAGODA_<FLAG>`` variables as defaults of a command's flags (as containers and
    orchestrators configure a server): ``PAGODA_MAX_MODEL_LEN=4096`` is ``--max-model-len
    4096``, ``PAGODA_MODEL`` the model, ``PAGODA_ENABLE_LORA=1`` a switch (1/true/yes/on or
    0/false/no/off), a list flag's values separated by spaces; set but empty is unset. A
    value the flag would refuse is an error naming the variable; ``PAGODA_*`` variables
    that name no flag (``PAGODA_CPU_ISA``, ...) are left alone."""
    defaults = {}
    for dest, action in _settable(parser).items():
        name = ENV_PREFIX + dest.upper()
        raw = environ.get(name)
        if raw is None or (not raw.strip() and not _is_switch(action)):
            continue
        try:
            defaults[dest] = _convert(action, raw.strip())
        except (argparse.ArgumentTypeError, ValueError) as e:
            parser.error(f"environment variable {name}: {e}")
    parser.set_defaults(**defaults)


def read_config_file(path: str) -> dict[str, Any]:
    """A ``--config`` file: a YAML mapping of option names (``max-model-len`` or
    ``max_model_len``) to values."""
    import yaml

    try:
        with open(path) as f:
            data = yaml.safe_load(f)
    except OSError as e:
        raise ValueError(f"--config {path}: {e.strerror or e}") from None
    except yaml.YAMLError as e:
        raise ValueError(f"--config {path}: not valid YAML: {e}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"--config {path}: expected a mapping of option names to values, got {type(data).__name__}")
    return data


def apply_config_file(parser: argparse.ArgumentParser, path: str) -> None:
    """The options of a ``--config`` file as the defaults of a command's flags (the
    environment and the command line win over them). A key that names no flag of the
    command, or a value the flag would refuse, is an error naming the file and the key."""
    settable = _settable(parser)
    defaults = {}
    for key, value in read_config_file(path).items():
        dest = str(key).lstrip("-").replace("-", "_")
        action = settable.get(dest)
        if action is None:
            raise ValueError(f"--config {path}: {key!r} is not an option of this command "
                             f"(see --help or docs/configuration.md)")
        try:
            defaults[dest] = _convert(action, value)
        except (argparse.ArgumentTypeError, ValueError) as e:
            raise ValueError(f"--config {path}: {key}: {e}") from None
    parser.set_defaults(**defaults)


def config_file_argument(argv: list[str]) -> str | None:
    """The value of ``--config FILE`` / ``--config=FILE`` in ``argv``, read before the
    command line is parsed (its options become the parser's defaults)."""
    for i, arg in enumerate(argv):
        if arg == "--":
            break
        if arg == "--config" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--config="):
            return arg.split("=", 1)[1]
    return None


# --- the reference page -----------------------------------------------------------------------

def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;").replace("\n", " ")


def reference_markdown(parser: argparse.ArgumentParser, groups: Iterable[type[OptionGroup]],
                       env_commands: str) -> str:
    """docs/configuration.md: every flag of ``parser`` (``pagoda serve``'s) by argument
    group, with its environment variable, default and choices; then the options that only
    Python sets, from ``groups``."""
    lines = [
        "# Configuration",
        "",
        "<!-- Generated by `python -m pagoda.entrypoints.options_reference > docs/configuration.md` from the",
        "     option definitions (pagoda/config/engine.py, the server's flags); do not edit by hand. -->",
        "",
        "Every option of `pagoda serve`, grouped as `pagoda serve --help` shows them. `pagoda generate`,",
        "`chat`, `run` and `bench` take the engine's groups (all but the server's own flags).",
        "",
        "Each option can be given three ways besides its default; the first that is set wins:",
        "",
        "1. on the command line: `--max-model-len 4096`;",
        f"2. as an environment variable ({env_commands}): `PAGODA_MAX_MODEL_LEN=4096`; a switch takes",
        "   `1/true/yes/on` or `0/false/no/off`, a list its values separated by spaces;",
        "3. in a YAML file given with `--config FILE.yaml`, keys spelled as the flags without their dashes",
        "   (`max-model-len: 4096` or `max_model_len: 4096`); a JSON option may be written as YAML.",
        "",
        "The offline Python API takes the same options as keyword arguments of `LLM(...)`",
        "(`LLM(max_model_len=4096)`), by their field names.",
        "",
    ]
    for arg_group in parser._action_groups:
        actions = [a for a in arg_group._group_actions
                   if not isinstance(a, argparse._HelpAction) and a.dest != argparse.SUPPRESS]
        if not actions:
            continue
        title = arg_group.title if arg_group.title not in (None, "options") else "general"
        lines += [f"## {title[0].upper() + title[1:]}", ""]
        if arg_group.description:
            lines += [arg_group.description, ""]
        lines += ["| option | environment | what it does |", "|---|---|---|"]
        for a in actions:
            flags = ", ".join(f"`{s}`" for s in a.option_strings) or f"`{a.dest}` (positional)"
            env = "" if a.dest == "config" else f"`{ENV_PREFIX}{a.dest.upper()}`"
            text = (a.help or "").replace("%%", "%")
            if "default" not in text and a.default not in (None, [], argparse.SUPPRESS) and a.default is not False:
                text += f" (default: {a.default})"
            if a.choices is not None:
                text += f". Choices: {', '.join(f'`{c}`' for c in a.choices)}."
            lines.append(f"| {flags} | {env} | {_cell(text)} |")
        lines.append("")
    python_only = [o for g in groups for o in options_of(g) if not o.spec.cli]
    if python_only:
        lines += ["## Set from Python only", "",
                  "Fields of `EngineConfig` (keyword arguments of `LLM(...)`) that no flag sets.", "",
                  "| field | default | what it does |", "|---|---|---|"]
        for o in python_only:
            lines.append(f"| `{o.name}` | `{o.default}` | {_cell(o.spec.help)} |")
        lines.append("")
    return "\n".join(lines)


def environment_names(groups: Iterable[type[OptionGroup]]) -> list[str]:
    """Every engine option's variable (for tests and docs)."""
    return [o.env for g in groups for o in options_of(g) if o.spec.cli]
