"""Walking nested state dicts (dicts and lists) by leaf path."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

TreePath = tuple


def iter_leaves(tree: Any, path: TreePath = ()) -> Iterator[tuple[TreePath, Any]]:
    """Yield ``(path, leaf)`` for every non-container value, depth first, in insertion order."""
    if isinstance(tree, dict):
        for key, value in tree.items():
            yield from iter_leaves(value, path + (key,))
    elif isinstance(tree, list):
        for index, value in enumerate(tree):
            yield from iter_leaves(value, path + (index,))
    else:
        yield path, tree


def map_leaves(fn: Callable[[TreePath, Any], Any], tree: Any, path: TreePath = ()) -> Any:
    """A copy of the containers of ``tree`` with each leaf replaced by ``fn(path, leaf)``."""
    if isinstance(tree, dict):
        return {key: map_leaves(fn, value, path + (key,)) for key, value in tree.items()}
    if isinstance(tree, list):
        return [map_leaves(fn, value, path + (index,)) for index, value in enumerate(tree)]
    return fn(path, tree)


def get_path(tree: Any, path: TreePath) -> Any:
    for part in path:
        tree = tree[part]
    return tree


def set_path(tree: Any, path: TreePath, value: Any) -> None:
    """Set ``tree[path] = value``, creating missing dict levels on the way."""
    for part in path[:-1]:
        if isinstance(tree, dict) and part not in tree:
            tree[part] = {}
        tree = tree[part]
    tree[path[-1]] = value
