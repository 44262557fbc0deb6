"""Module paths of a model: which numbered layer (``model.layers.7``) a module belongs to."""

from __future__ import annotations

import re

_INDEX = re.compile(r"\.(\d+)(?=\.|$)")


def layer_key(module: str) -> tuple[str, int] | None:
    """("model.layers.*.mlp", 7) for "model.layers.7.mlp"; None outside numbered layers.

    Only the first number is the layer: inner numbered containers (e.g. a
    Sequential inside a block) belong to the copy they sit in.
    """
    m = _INDEX.search(module)
    if m is None:
        return None
    return module[: m.start()] + ".*" + module[m.end() :], int(m.group(1))
