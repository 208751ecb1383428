"""Package faces that import their parts on first use: `tunekit.data.load_records` imports `tunekit/data/records.py`
when it is first read, so importing one part of a package does not import the others (PEP 562)."""

from __future__ import annotations

import importlib


def lazy_face(package: str, parts: tuple[str, ...]):
    """(`__getattr__`, `__dir__`) for the `__init__.py` of `package`: a name is looked up in `parts` in order,
    each imported when first needed; a part is itself a name (`tunekit.data.records`)."""

    def __getattr__(name: str):
        if name in parts:
            return importlib.import_module(f"{package}.{name}")
        for part in parts:
            module = importlib.import_module(f"{package}.{part}")
            value = module.__dict__.get(name)
            if value is not None and getattr(value, "__module__", module.__name__) == module.__name__:
                return value
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def __dir__() -> list[str]:
        return sorted({*importlib.import_module(package).__dict__, *parts})

    return __getattr__, __dir__
