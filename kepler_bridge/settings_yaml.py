"""The YAML loaders of the config file (scalars as written) and of the web config, both refusing a
key given twice. Imported only where a YAML file is read, so that an agent without one never loads
PyYAML."""

from __future__ import annotations

import re

import yaml
from yaml import YAMLError

__all__ = ["YAMLError", "load", "load_safe"]

_NULL, _INT = "tag:yaml.org,2002:null", "tag:yaml.org,2002:int"
_MERGE = "tag:yaml.org,2002:merge"
_DECIMAL = re.compile(r"^(?:0|[1-9][0-9]{0,17})$")


# libyaml's parser where PyYAML has it (its wheels and Debian's do): some 5 x faster on a large
# file, which a reload parses on the sampler's thread.
_SAFE: type[yaml.SafeLoader] = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class UniqueKeys(_SAFE):  # type: ignore[valid-type,misc]
    """PyYAML's safe loader, except that a mapping with a key twice is an error, as in
    exporter-toolkit's strict YAML: PyYAML would keep the later one without a word."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        if isinstance(node, yaml.MappingNode):
            seen: set[object] = set()
            for key_node, _ in node.value:
                if key_node.tag == _MERGE or not isinstance(key_node, yaml.ScalarNode):
                    continue  # merged keys may be overridden; a non-scalar key is refused below
                key = self.construct_object(key_node, deep=True)
                if key in seen:
                    raise yaml.constructor.ConstructorError(
                        None,
                        None,
                        f"key {key!r} given twice (keep one: the later would win)",
                        key_node.start_mark,
                    )
                seen.add(key)
        return super().construct_mapping(node, deep)


class ScalarsAsWritten(UniqueKeys):
    """YAML that keeps a scalar's text: only null and decimal whole numbers get a type, so
    `interval: 1:30` stays "1:30" (not 90 seconds), `node_name: 0123` stays "0123" (not 83) and
    `yes` stays "yes"."""

    yaml_implicit_resolvers = {
        first: [(tag, regexp) for tag, regexp in resolvers if tag == _NULL]
        for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
    }
    yaml_constructors = {
        tag: yaml.SafeLoader.yaml_constructors[tag]
        for tag in (
            None,
            _NULL,
            "tag:yaml.org,2002:str",
            "tag:yaml.org,2002:seq",
            "tag:yaml.org,2002:map",
        )
    }

    def construct_decimal(self, node: yaml.ScalarNode) -> int:
        """An int from decimal digits; an explicit `!!int` with anything else (0x10, 1:30) is
        refused."""
        text = self.construct_scalar(node)
        if not _DECIMAL.match(text):
            raise yaml.constructor.ConstructorError(
                None, None, f"{text!r} is not a whole number in decimal digits", node.start_mark
            )
        return int(text)


ScalarsAsWritten.add_implicit_resolver(_INT, _DECIMAL, list("0123456789"))
ScalarsAsWritten.add_constructor(_INT, ScalarsAsWritten.construct_decimal)


def load(text: str) -> object:
    """The YAML document in `text`, its scalars as written."""
    return yaml.load(text, Loader=ScalarsAsWritten)


def load_safe(text: bytes | str) -> object:
    """The YAML document in `text` as PyYAML's safe_load reads it, a key given twice refused."""
    return yaml.load(text, Loader=UniqueKeys)
