"""YAML read safely and strictly: one document, plain values, no value that
YAML 1.1 and 1.2 read apart.

Example:
    >>> import pathlib, tempfile
    >>> path = pathlib.Path(tempfile.mkdtemp()) / "run.yaml"
    >>> _ = path.write_text("loader:\\n  seed: 0x1F\\n")
    >>> read_yaml(path)
    {'loader': {'seed': 31}}
"""

from __future__ import annotations

import os
import re
import sys
from typing import Any

from flat_tokens_jax.core.extras import install_hint
from flat_tokens_jax.core.values import child

# A config nests a few levels deep; a document far deeper (or far larger once
# its aliases expand) is not one, and would exhaust Python's recursion (or
# memory) in the code that reads it.
MAX_YAML_DEPTH = 100
MAX_YAML_VALUES = 1_000_000
# YAML 1.1 booleans (PyYAML's) that YAML 1.2 reads as text.
_YAML11_BOOLS = {"yes": "true", "on": "true", "no": "false", "off": "false"}


def read_yaml(path: str | os.PathLike[str]) -> Any:
    """The document of a YAML file, read safely (``yaml.SafeLoader``; needs the
    ``yaml`` extra) and strictly.

    Refused: a key given twice in one mapping (YAML keeps the last silently);
    a plain value that YAML 1.1 (PyYAML) and 1.2 read differently (``017`` is
    15 or 17, ``yes`` true or text); a document deeper than
    :data:`MAX_YAML_DEPTH` or over :data:`MAX_YAML_VALUES` values once its
    aliases expand. ``ValueError`` names the file, the line, the value's path
    and the form to write.
    """
    try:
        import yaml
    except ImportError as e:
        raise ImportError(f"reading YAML needs PyYAML: {install_hint('yaml')}") from e
    name = os.fspath(path)
    with open(path, encoding="utf-8") as f:
        loader = None
        try:
            loader = yaml.SafeLoader(f)  # reads the first bytes: a NUL is refused here
            node = loader.get_single_node()
            if node is None:
                return None
            problem = _shape_problem(node, yaml) or _scalar_problem(node, loader, yaml)
            if problem is not None:
                raise ValueError(f"{name}: {problem}")
            return loader.construct_document(node)
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f" line {mark.line + 1}:" if mark is not None else ""
            what = getattr(e, "problem", None) or str(e).splitlines()[0]
            if isinstance(e, yaml.constructor.ConstructorError):
                what += " (YAML is read safely: plain values only, no !!python tags)"
            raise ValueError(f"{name}:{where} not valid YAML: {what}") from None
        except UnicodeDecodeError as e:
            raise ValueError(f"{name}: not a UTF-8 text file ({e.reason})") from None
        except RecursionError:
            raise ValueError(
                f"{name}: nested more than {MAX_YAML_DEPTH} levels deep: not a config"
            ) from None
        finally:
            if loader is not None:
                loader.dispose()


def _shape_problem(root: Any, yaml: Any) -> str | None:
    """Why the document under ``root`` is too deep or too large once its aliases
    expand, or holds itself; ``None`` if it is not."""
    height: dict[int, int] = {}
    values: dict[int, int] = {}
    open_nodes: set[int] = set()
    todo = [(root, False)]
    while todo:
        node, children_done = todo.pop()
        if id(node) in height:
            continue
        kids = [] if isinstance(node, yaml.ScalarNode) else list(node.value)
        if isinstance(node, yaml.MappingNode):
            kids = [part for pair in kids for part in pair]
        if not children_done:
            if id(node) in open_nodes:  # reached again from inside itself
                line = node.start_mark.line + 1
                return f"line {line}: an alias inside the value it names (a cycle): not a config"
            open_nodes.add(id(node))
            todo.append((node, True))
            todo += [(kid, False) for kid in kids]
            continue
        open_nodes.discard(id(node))
        height[id(node)] = 1 + max((height[id(k)] for k in kids), default=0)
        values[id(node)] = 1 + sum(values[id(k)] for k in kids)
    if height[id(root)] > MAX_YAML_DEPTH:
        return f"nested more than {MAX_YAML_DEPTH} levels deep: not a config"
    if values[id(root)] > MAX_YAML_VALUES:
        return (
            f"holds {values[id(root)]:,} values once its aliases expand, more than "
            f"{MAX_YAML_VALUES:,}: not a config"
        )
    return None


def _scalar_problem(root: Any, loader: Any, yaml: Any) -> str | None:
    """``line N: path: why and the form to write`` of the first plain value
    under ``root`` that :func:`_yaml11_reading` refuses, or of a plain key that
    a mapping holds twice; ``None`` if none."""
    seen: set[int] = set()
    todo: list[tuple[Any, str, bool]] = [(root, "", False)]
    while todo:
        node, path, is_key = todo.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, yaml.ScalarNode):
            why = _yaml11_reading(node, loader)
            if why is not None:
                where = f"{path or 'the document'}: " + ("the key " if is_key else "")
                return f"line {node.start_mark.line + 1}: {where}{why}"
        elif isinstance(node, yaml.MappingNode):
            keys: set[tuple[str, str]] = set()
            for key, _ in node.value:
                if isinstance(key, yaml.ScalarNode) and key.tag != "tag:yaml.org,2002:merge":
                    if (key.tag, key.value) in keys:
                        line = key.start_mark.line + 1
                        return f"line {line}: the key {key.value!r} is given twice"
                    keys.add((key.tag, key.value))
            for key, value in reversed(node.value):
                label = key.value if isinstance(key, yaml.ScalarNode) else "?"
                todo += [(value, child(path, label), False), (key, path, True)]
        elif isinstance(node, yaml.SequenceNode):
            todo += [
                (item, child(path, i), False) for i, item in reversed(list(enumerate(node.value)))
            ]
    return None


def _yaml11_reading(node: Any, loader: Any) -> str | None:
    """Why a scalar node must be written otherwise, or ``None``: PyYAML (YAML
    1.1) reads it as another value than YAML 1.2 does, or no int can hold it."""
    if node.style is not None:  # quoted: text to both
        return None
    text, kind = node.value, node.tag.rsplit(":", 1)[-1]
    body = text.lstrip("+-")
    digits = body.replace("_", "")
    limit = sys.get_int_max_str_digits()
    if kind in ("int", "str") and digits.isdigit() and limit and len(digits) > limit:
        return f"a number of {len(digits):,} digits: no config value needs more than 20"
    quoted = f"'{text}' in quotes for text"
    if kind == "bool" and text.lower() in _YAML11_BOOLS:
        word = _YAML11_BOOLS[text.lower()]
        return f"{text} is {word} in YAML 1.1 and text in YAML 1.2: write {word} ({quoted})"
    if kind in ("int", "float") and ":" in body:
        if len(body) > 30:  # its value may have more digits than Python prints
            return f"{text} is a number in base 60 in YAML 1.1 and text in YAML 1.2: quote it"
        read = loader.construct_object(node)
        return (
            f"{text} is {read} in YAML 1.1 (base 60) and text in YAML 1.2: write {read} ({quoted})"
        )
    if kind in ("int", "str") and re.fullmatch(r"0[0-9_]+", body):
        decimal = int(text.replace("_", ""), 10)
        if kind == "str":
            return (
                f"{text} is text in YAML 1.1 and {decimal} in YAML 1.2: write {decimal} ({quoted})"
            )
        octal = loader.construct_object(node)
        if octal != decimal:
            return (
                f"{text} is {octal} in YAML 1.1 (octal) and {decimal} in YAML 1.2: write "
                f"{octal} or {decimal}, without the leading zero ({quoted})"
            )
    if kind == "str" and re.fullmatch(r"0o[0-7]+", body):
        value = int(text.replace("0o", ""), 8)
        return f"{text} is text in YAML 1.1 and {value} in YAML 1.2: write {value} ({quoted})"
    return None
