"""Command-line overrides of a scenario: ``tpu-pod run s.yaml training.steps=10 pod.mesh.fsdp=8``.

An override is ``KEY=VALUE``: KEY a dotted path into the scenario's YAML
mapping (``pod.mesh.fsdp``; a number indexes a list: ``faults.0.step``), VALUE
read as YAML, so scalars and flow collections work as in the file
(``pod.mesh={data: 2, fsdp: 4}``, ``sweep.remat=[none, full]``, ``pod.slice=v5p-128``;
an empty VALUE is ``null``, the key's default). Overrides are applied in order
to the mapping *before* it is validated, so they are checked exactly as the file
is: a bad key or value is the file's one-line error, with the override that set
it named at the end. As in Hydra and MaxText, the last word wins.

A dotted key merges into a mapping (``pod.mesh.fsdp=8`` keeps the mesh's other
axes); a whole value replaces it (``pod.mesh={fsdp: 8}``). Missing mappings
on the way are created. Keys that exclude one another follow the override:
``training.steps`` drops the file's ``training.epochs`` (and the reverse);
``pod.slice`` drops the file's ``pod.chip``, ``pod.chips`` and ``pod.topology``;
``pod.chip`` drops ``pod.slice``; ``pod.chips`` drops ``pod.slice`` and
``pod.topology``; ``pod.topology`` drops ``pod.chips`` (unless the overrides set
them too).
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pod.config.scenario import (
    Scenario,
    load_scenario,
    load_yaml,
    parse_scenario,
    scenario_from_text,
)
from pod.errors import ScenarioError

__all__ = ["Override", "parse_override", "as_overrides", "apply_overrides", "blame",
           "looks_like_override", "load_with_overrides", "text_with_overrides",
           "scenario_with_overrides", "MAX_OVERRIDE_CHARS"]

#: The longest ``KEY=VALUE`` accepted (a command-line value, not a file).
MAX_OVERRIDE_CHARS = 4096

_PART = r"(?:[A-Za-z_][A-Za-z0-9_]*|[0-9]+)"
_KEY_RE = re.compile(rf"^{_PART}(?:\.{_PART})*$")
_OVERRIDE_RE = re.compile(rf"^\s*({_PART}(?:\.{_PART})*)\s*=(.*)$", re.DOTALL)

#: Setting the key drops these of the scenario (unless an override sets them too).
REPLACES: dict[str, tuple[str, ...]] = {
    "training.steps": ("training.epochs",),
    "training.epochs": ("training.steps",),
    "pod.slice": ("pod.chip", "pod.chips", "pod.topology"),
    "pod.chip": ("pod.slice",),
    "pod.chips": ("pod.slice", "pod.topology"),
    "pod.topology": ("pod.chips",),
}


@dataclass(frozen=True)
class Override:
    """One ``KEY=VALUE``.

    Attributes:
        key: the dotted path, e.g. ``"pod.mesh.fsdp"``.
        value: the value (parsed YAML from the command line; any value from Python).
        text: as given, for messages (``"pod.mesh.fsdp=8"``).
    """

    key: str
    value: Any
    text: str

    @property
    def parts(self) -> tuple[str, ...]:
        """The key's parts: ``("pod", "mesh", "fsdp")``."""
        return tuple(self.key.split("."))


def _syntax_error(text: str) -> ScenarioError:
    shown = text if len(text) <= 80 else text[:77] + "..."
    return ScenarioError(f"override {shown!r}: expected KEY=VALUE with a dotted KEY of the "
                         f"scenario and a YAML VALUE, e.g. training.steps=10, "
                         f"pod.mesh.fsdp=8 or pod.mesh={{data: 2, fsdp: 4}}")


def parse_override(text: str) -> Override:
    """``"pod.mesh={data: 2, fsdp: 4}"`` -> Override("pod.mesh", {"data": 2, "fsdp": 4}).

    Raises:
        ScenarioError: not ``KEY=VALUE`` with a dotted key, longer than
            ``MAX_OVERRIDE_CHARS``, or a VALUE that is not valid YAML (one line).
    """
    if not isinstance(text, str) or len(text) > MAX_OVERRIDE_CHARS:
        raise _syntax_error(str(text)[:80]) if isinstance(text, str) else ScenarioError(
            f"override {text!r:.80}: expected a KEY=VALUE string, got {type(text).__name__}")
    match = _OVERRIDE_RE.match(text)
    if not match:
        raise _syntax_error(text)
    key, raw = match.group(1), match.group(2)
    try:
        value = load_yaml(raw, source=key) if raw.strip() else None
    except ScenarioError as err:  # the value is one line: its column is what helps
        message = str(err).replace("invalid YAML at line 1, column", "invalid YAML value at column")
        raise ScenarioError(f"{message} (override {text[:80]})") from None
    return Override(key=key, value=value, text=text.strip())


def as_overrides(items: Iterable[str | Override] | Mapping[str, Any] | None
                 ) -> tuple[Override, ...]:
    """Overrides from ``["k=v", ...]`` (VALUE read as YAML) or ``{"k": value}`` (values as given).

    Raises:
        ScenarioError: a malformed item or key (one line).
    """
    if items is None:
        return ()
    if isinstance(items, str):
        items = [items]
    if isinstance(items, Mapping):
        out = []
        for key, value in items.items():
            if not isinstance(key, str) or not _KEY_RE.match(key):
                raise _syntax_error(f"{key}=...")
            out.append(Override(key=key, value=value, text=f"{key}={value!r:.80}"))
        return tuple(out)
    return tuple(item if isinstance(item, Override) else parse_override(item) for item in items)


def looks_like_override(text: str) -> bool:
    """Whether a command-line argument is meant as ``KEY=VALUE``: it holds ``=`` and is
    neither an existing file nor a ``.yaml`` / ``.yml`` name (a malformed one is then
    refused by ``parse_override`` with the syntax, not as a missing file)."""
    if "=" not in text or text.rstrip().endswith((".yaml", ".yml")):
        return False
    try:
        return not Path(text).exists()
    except OSError:  # a name the OS refuses (too long) is no file
        return True


def _kind(value: Any) -> str:
    if isinstance(value, list):
        return f"a list of {len(value)}"
    return f"{type(value).__name__} {value!r:.40}"


def _set(tree: dict, override: Override) -> None:
    """Set ``override.value`` at its key in ``tree`` (in place), creating mappings on the way."""
    node: Any = tree
    parts = override.parts
    for depth, part in enumerate(parts):
        last = depth == len(parts) - 1
        where = ".".join(parts[:depth]) or "<top level>"
        if isinstance(node, dict):
            if last:
                node[part] = copy.deepcopy(override.value)
                return
            if not isinstance(node.get(part), (dict, list)):
                here = ".".join(parts[:depth + 1])
                if node.get(part) is not None:
                    raise ScenarioError(f"{here}: is {_kind(node[part])}, not a mapping, so it "
                                        f"has no key {parts[depth + 1]!r} "
                                        f"(override {override.text:.120})")
                if parts[depth + 1].isdigit():
                    raise ScenarioError(f"{here}: is not set, so it has no item "
                                        f"{parts[depth + 1]}; give the whole list "
                                        f"(override {override.text:.120})")
                node[part] = {}
            node = node[part]
        elif isinstance(node, list):
            if not part.isdigit() or int(part) >= len(node):
                raise ScenarioError(f"{where}: is a list of {len(node)}; {part!r} is not an index "
                                    f"of it (0 to {len(node) - 1}) (override {override.text:.120})")
            if last:
                node[int(part)] = copy.deepcopy(override.value)
                return
            node = node[int(part)]


def _drop(tree: dict, key: str) -> None:
    """Remove ``key`` (dotted) from ``tree`` if present."""
    *head, last = key.split(".")
    node: Any = tree
    for part in head:
        node = node.get(part) if isinstance(node, dict) else None
    if isinstance(node, dict):
        node.pop(last, None)


def apply_overrides(data: Mapping[str, Any], overrides: Iterable[str | Override] |
                    Mapping[str, Any] | None) -> dict[str, Any]:
    """A copy of the scenario mapping ``data`` with ``overrides`` applied, in order.

    Keys that exclude one another are dropped as ``REPLACES`` says. Nothing is
    validated here: the result goes to ``parse_scenario`` like a file.

    Raises:
        ScenarioError: a malformed override, or a key that goes through a value that
            is neither a mapping nor a list (one line naming the key and the value).
    """
    tree = copy.deepcopy(dict(data))
    items = as_overrides(overrides)
    keys = {o.key for o in items}
    for override in items:
        _set(tree, override)
    for override in items:
        for other in REPLACES.get(override.key, ()):
            if other not in keys:
                _drop(tree, other)
    return tree


def blame(message: str, overrides: Iterable[Override]) -> str:
    """``message`` with the overrides that set its field named at the end.

    The field is a dotted path the message names (``<file>: <field>: ...``). An
    override is named when its key and the field are one inside the other
    (``pod.mesh.fsdp=8`` for ``pod.mesh``); failing that, the overrides of the
    field's section (``pod.slice=v3-8`` for ``pod.mesh``: a new slice can break a
    mesh). Messages naming no field of an override are returned as they are.
    """
    fields = [tuple(f.split(".")) for f in
              re.findall(rf"(?:^|(?<=: ))({_PART}(?:\.{_PART})*)(?=: )", message)]
    items = list(overrides)
    if not fields or not items or "(override " in message:
        return message
    inside = [o for o in items
              if any(o.parts[:len(f)] == f or f[:len(o.parts)] == o.parts for f in fields)]
    named = inside or [o for o in items if any(o.parts[0] == f[0] for f in fields)]
    if not named:
        return message
    texts = [o.text if len(o.text) <= 120 else o.text[:117] + "..." for o in named]
    return f"{message} (override {', '.join(texts)})"


def _blamed(load: Callable[[], Scenario], items: tuple[Override, ...]) -> Scenario:
    try:
        return load()
    except ScenarioError as err:
        raise ScenarioError(blame(str(err), items)) from None


def _editor(items: tuple[Override, ...], source: str) -> Callable[[dict], dict]:
    """``apply_overrides`` for a scenario's ``edit`` hook; its errors name the file first."""
    def edit(data: dict) -> dict:
        try:
            return apply_overrides(data, items)
        except ScenarioError as err:
            raise ScenarioError(f"{source}: {err}") from None
    return edit


def load_with_overrides(path: str | Path, overrides: Iterable[str | Override] |
                        Mapping[str, Any] | None) -> Scenario:
    """``load_scenario(path)`` with ``overrides`` applied to the file's mapping before it
    is validated.

    Raises:
        ScenarioError: as ``load_scenario``, the override that set a bad field named.
    """
    items = as_overrides(overrides)
    return _blamed(lambda: load_scenario(path, edit=_editor(items, str(path))), items)


def text_with_overrides(text: str, overrides: Iterable[str | Override] | Mapping[str, Any] | None,
                        *, source: str = "<yaml>", base_dir: str | Path = ".") -> Scenario:
    """``scenario_from_text`` with ``overrides`` applied before validation."""
    items = as_overrides(overrides)
    return _blamed(lambda: scenario_from_text(text, source=source, base_dir=base_dir,
                                              edit=_editor(items, source)), items)


def scenario_with_overrides(scenario: Scenario | Mapping[str, Any],
                            overrides: Iterable[str | Override] | Mapping[str, Any] | None,
                            *, source: str = "<dict>") -> Scenario:
    """A ``Scenario`` (or a scenario mapping) with ``overrides`` applied, validated again."""
    items = as_overrides(overrides)
    data = scenario.model_dump() if isinstance(scenario, Scenario) else dict(scenario)
    return _blamed(lambda: parse_scenario(_editor(items, source)(data), source=source), items)
