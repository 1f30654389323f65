"""Build a validated ``PipelineConfig`` from a preset or YAML file plus ``dotted.key=value`` overrides."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, get_args

import yaml
from pydantic import BaseModel, ValidationError

from cache import POLICIES
from cascade.errors import CascadeError
from configs.schema import PipelineConfig

PRESET_DIR = Path(__file__).parent / "presets"
DEFAULT_PRESET = "self-spec"  # not "triforce": the shipped draft is accepted too rarely to pay (README)


def preset_names() -> list[str]:
    return sorted(path.stem for path in PRESET_DIR.glob("*.yaml"))


def read_yaml(path: Path) -> dict[str, Any]:
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise CascadeError(f"cannot read config file {path}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise CascadeError(f"config file {path} is not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise CascadeError(f"config file {path} must hold a mapping of settings, got {type(data).__name__}")
    return data


def preset_data(name: str) -> dict[str, Any]:
    if name not in preset_names():
        raise CascadeError(f"unknown preset {name!r}; available presets: {', '.join(preset_names())}")
    return read_yaml(PRESET_DIR / f"{name}.yaml")


def apply_override(data: dict[str, Any], assignment: str) -> None:
    """Apply one ``dotted.key=value`` (value parsed as YAML; list items addressed by index)."""
    key, sep, raw = assignment.partition("=")
    if not sep or not key:
        raise CascadeError(f"--set expects dotted.key=value, got {assignment!r}")
    try:
        value = yaml.safe_load(raw) if raw else ""
    except yaml.YAMLError:
        value = raw
    set_value(data, key, value)


def policy_at_budget(policy: str, budget: int) -> dict[str, Any]:
    """The cache config ``policy`` names (``kind`` or ``kind:key=value,...``, values as YAML),
    holding ``budget`` tokens, as settings."""
    kind, _, assignments = policy.partition(":")
    if kind not in POLICIES:
        raise CascadeError(f"unknown cache policy {kind!r}; registered: {', '.join(sorted(POLICIES))}")
    data = POLICIES[kind].config.at_budget(budget).as_settings()
    for assignment in filter(None, assignments.split(",")):
        apply_override(data, assignment)
    return data


def policy_option(text: str) -> str:
    """argparse type for a cache policy named as ``policy_at_budget`` reads it."""
    try:
        policy_at_budget(text, budget=16)
    except CascadeError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def set_value(data: dict[str, Any], key: str, value: Any) -> None:
    """Set ``data[a][b][c] = value`` for ``key = "a.b.c"``, creating missing groups."""
    *parents, leaf = key.split(".")
    node: Any = data
    for part in parents:
        node = _child(node, part, key)
    if isinstance(node, list):
        node[_index(node, leaf, key)] = value
        return
    if parents and parents[-1] == "cache" and leaf == "kind" and value in POLICIES and node.get(leaf) != value:
        _keep_settings_of(node, value)
    node[leaf] = value


def _keep_settings_of(cache: dict[str, Any], kind: str) -> None:
    """A cache group switched to ``kind`` keeps only the settings that kind has (``--set
    stages.0.cache.kind=full`` over a preset's streaming window): the rest were the old kind's."""
    for name in [name for name in cache if name not in POLICIES[kind].config.model_fields]:
        del cache[name]


def _child(node: Any, part: str, key: str) -> Any:
    if isinstance(node, list):
        return node[_index(node, part, key)]
    child = node.get(part)
    if child is None:
        child = node[part] = {}
    if not isinstance(child, (dict, list)):
        whole, _, rest = key.partition(f"{part}.")
        raise CascadeError(
            f"--set {key}: {part!r} is a single value ({child!r}), not a group of settings; to make it "
            f"one, set it whole, e.g. --set {whole}{part}='{{{rest}: VALUE}}'"
        )
    return child


def _index(node: list, part: str, key: str) -> int:
    if not part.isdigit() or int(part) >= len(node):
        raise CascadeError(f"--set {key}: {part!r} is not an index of a {len(node)}-item list")
    return int(part)


def load_config(
    preset: str | None = None,
    file: Path | None = None,
    overrides: list[str] = (),
    settings: dict[str, Any] | None = None,
) -> tuple[str, PipelineConfig]:
    """Returns (name, config): name is the preset's, or the file's stem.

    ``overrides`` are ``dotted.key=value`` strings (``--set``); ``settings`` maps dotted keys to
    already-typed values (the CLI's own flags) and is applied last.
    """
    if preset and file:
        raise CascadeError("give either --preset or --config, not both")
    name = file.stem if file else preset or DEFAULT_PRESET
    data = read_yaml(file) if file else preset_data(name)
    for assignment in overrides:
        apply_override(data, assignment)
    for key, value in (settings or {}).items():
        set_value(data, key, value)
    return name, validate(data)


def validate(data: dict[str, Any]) -> PipelineConfig:
    try:
        return PipelineConfig.model_validate(data)
    except ValidationError as exc:
        raise CascadeError(describe_errors(exc, data)) from None


def describe_errors(exc: ValidationError, data: dict[str, Any]) -> str:
    """One line per problem, naming the dotted key; unknown keys list the allowed ones."""
    lines = ["invalid config:"]
    for error in exc.errors():
        loc = [part for part in error["loc"] if not _is_union_tag(part)]
        key = ".".join(str(part) for part in loc)
        if error["type"] == "extra_forbidden":
            allowed = ", ".join(allowed_keys(data, loc[:-1]))
            lines.append(f"  {key}: unknown setting; allowed here: {allowed}")
        else:
            lines.append(f"  {key or '(top level)'}: {error['msg']}")
    return "\n".join(lines)


def _is_union_tag(part: Any) -> bool:
    """pydantic puts the discriminator's value (e.g. 'full') into error locations; hide it."""
    return isinstance(part, str) and part in POLICIES


def allowed_keys(data: dict[str, Any], loc: list) -> list[str]:
    """Field names of the schema model at ``loc`` (the data picks the member of a union)."""
    model: type[BaseModel] = PipelineConfig
    node: Any = data
    for part in loc:
        node = node[part]
        if isinstance(part, str):
            model = _submodel(model.model_fields[part].annotation, node)
    return list(model.model_fields)


def _submodel(annotation: Any, node: Any) -> type[BaseModel]:
    """The BaseModel inside an annotation such as ``list[X]``, ``X | None`` or a tagged union."""
    models = [t for t in _flatten(annotation) if isinstance(t, type) and issubclass(t, BaseModel)]
    kind = node.get("kind") if isinstance(node, dict) else None
    tagged = [m for m in models if "kind" in m.model_fields and m.model_fields["kind"].default == kind]
    return (tagged or models)[0]


def _flatten(annotation: Any):
    yield annotation
    for arg in get_args(annotation):
        yield from _flatten(arg)
