"""User code named in a config: ``package.module:Name`` or ``path/to/file.py:Name``.

A config's ``model.name``, ``data.name`` and ``task`` may name a class or
function of the user's own, importable or in a file. :func:`resolve` imports
it, and every way that can fail (no such file, the import raises, no such name)
becomes one :class:`UserCodeError` line naming the config key.
"""

from __future__ import annotations

import difflib
import hashlib
import importlib
import importlib.util
import keyword
import os
import sys
from typing import Any

__all__ = ["is_reference", "one_line", "resolve", "UserCodeError"]


class UserCodeError(ValueError):
    """User code a config names cannot be found, imported or used; the message names the key."""


def is_reference(text: str) -> bool:
    """Whether ``text`` reads ``package.module:Name`` or ``path/to/file.py:Name`` (syntax only)."""
    if not isinstance(text, str):
        return False
    target, sep, attr = text.strip().rpartition(":")
    if not (sep and attr.isidentifier() and not keyword.iskeyword(attr)):
        return False
    if target.endswith(".py"):
        return len(target) > len(".py")
    return all(part.isidentifier() and not keyword.iskeyword(part) for part in target.split("."))


def resolve(reference: str, key: str) -> Any:
    """The object ``reference`` names (``pkg.mod:Name``, ``dir/file.py:Name``; a
    relative path is taken from the working directory).

    Raises:
      UserCodeError: naming ``key``, the reference and what went wrong.
    """
    if not is_reference(reference):
        raise UserCodeError(f"{key}: {reference!r} is not a reference; write package.module:Name or "
                            f"path/to/file.py:Name")
    where, _, name = reference.strip().rpartition(":")
    module = _load_file(where, key) if where.endswith(".py") else _import(where, key)
    obj: Any = module
    for part in name.split("."):
        if not hasattr(obj, part):
            public = [n for n in dir(obj) if not n.startswith("_")]
            close = difflib.get_close_matches(part, public, n=1)
            hint = f" Did you mean '{close[0]}'?" if close else ""
            raise UserCodeError(f"{key}: {where} has no attribute '{part}'.{hint} It defines: "
                                f"{', '.join(public[:20]) or 'nothing public'}")
        obj = getattr(obj, part)
    return obj


def _import(module_name: str, key: str) -> Any:
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name and module_name.startswith(e.name):
            raise UserCodeError(f"{key}: no module named '{e.name}' (from {module_name!r}); install it, add its "
                                f"directory to PYTHONPATH, or write a file path such as path/to/file.py:Name"
                                ) from None
        raise UserCodeError(f"{key}: importing {module_name} failed: {one_line(e)}") from None
    except SystemExit as e:
        raise UserCodeError(f"{key}: importing {module_name} called sys.exit({e.code!r}); a module a config names "
                            f"must not exit when imported (move that code under if __name__ == '__main__')") from None
    except Exception as e:  # noqa: BLE001 - the user's module raised while importing
        raise UserCodeError(f"{key}: importing {module_name} failed: {one_line(e)}") from None


def _load_file(path: str, key: str) -> Any:
    full = os.path.abspath(os.path.expanduser(path))
    if not os.path.isfile(full):
        raise UserCodeError(f"{key}: file {path} not found (looked for {full})")
    module_name = "user_code_" + hashlib.sha1(full.encode()).hexdigest()[:12]
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, full)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # dataclasses and pickling look the module up by name
    directory = os.path.dirname(full)
    if directory not in sys.path:
        sys.path.append(directory)  # the file's own imports of its neighbours
    try:
        spec.loader.exec_module(module)
    except SystemExit as e:
        del sys.modules[module_name]
        raise UserCodeError(f"{key}: importing {path} called sys.exit({e.code!r}); a file a config names must not "
                            f"exit when imported (move that code under if __name__ == '__main__')") from None
    except Exception as e:  # noqa: BLE001 - the user's file raised while importing
        del sys.modules[module_name]
        raise UserCodeError(f"{key}: importing {path} failed: {one_line(e)}") from None
    return module


def one_line(error: BaseException) -> str:
    """``Type: first line of the message`` of an exception raised by user code."""
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0][:300] if text else ''}".rstrip(": ")
