"""Every raise that can reach a user belongs to the tree in fedcore/errors.py.

The test reads the source (``ast``) of every package a user runs and fails on a ``raise`` of a builtin exception
(``ValueError``, ``TypeError``, ``RuntimeError``, ``KeyError``, ...) unless it is caught right where it is raised
(inside a ``try`` whose handler takes it: control flow that never leaves the function) or it is one of the
documented exceptions below. It also fails on an exception class that does not derive from ``FedcoreError``
unless it is listed as internal.
"""

from __future__ import annotations

import ast
import builtins
from pathlib import Path

import pytest

from fedcore.errors import ClientTaskError, ConfigError, EngineError, FedcoreError

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("fedcore", "server", "client", "privacy", "simulations")
GENERATED = ("_pb2.py", "_pb2_grpc.py")  # protoc's output, not ours

#: builtin raises allowed anywhere, with why
ALLOWED_EVERYWHERE = {
    "AssertionError": "unreachable code only (never user input: asserts and this vanish under python -O)",
}
#: (path, function, exception) -> why it is allowed there
ALLOWED_AT = {
    ("client/flower.py", "__missing__", "KeyError"): "the dict protocol: a missing key raises KeyError",
    ("fedcore/engine/__init__.py", "__getattr__", "AttributeError"): "the module __getattr__ protocol (PEP 562): "
    "an unknown name raises AttributeError",
    ("server/pool.py", "__getattr__", "AttributeError"): "the attribute protocol: a wrapper's own state, not set "
    "yet, is missing rather than looked up in the wrapped pool (which would recurse)",
    ("fedcore/engine/launch.py", "handler", "SystemExit"): "a SIGTERM handler ends the worker process with the "
    "signal's exit status",
    ("simulations/raypool.py", "_exit_on_sigterm", "SystemExit"): "a SIGTERM handler ends a run on Ray through "
    "its cleanup with the signal's exit status",
    ("simulations/raypool.py", "_schedule", "SystemExit"): "the same exit, which ray.wait had replaced with "
    "SystemExit(1)",
    ("server/sessions.py", "begin_call", "KeyError"): "an unknown session; server/service.py catches it and "
    "answers the client UNAUTHENTICATED (join again)",
    ("server/sessions.py", "wait_pull", "KeyError"): "as begin_call",
    ("server/grpc_pool.py", "lookup", "KeyError"): "as begin_call",
    ("server/service.py", "_abort", "RuntimeError"): "unreachable: grpc's context.abort always raises",
}
#: exception classes that are not FedcoreErrors, each raised and caught inside one module
INTERNAL_CLASSES = {
    ("server/app.py", "_Stop"): "SIGTERM inside the server's main thread; run_server catches it and stops cleanly",
    ("client/daemon.py", "_SessionLost"): "the daemon's loop catches it and joins again",
    ("client/daemon.py", "_Stopped"): "SIGTERM inside the daemon's main thread; ClientDaemon.run catches it and leaves",
}

BUILTIN_EXCEPTIONS = {
    name for name, value in vars(builtins).items() if isinstance(value, type) and issubclass(value, BaseException)
}


def _sources() -> list[Path]:
    files = [p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))]
    return [p for p in files if not p.name.endswith(GENERATED)]


def _raised_name(node: ast.Raise) -> str | None:
    exc = node.exc
    if isinstance(exc, ast.Call):
        exc = exc.func
    return exc.id if isinstance(exc, ast.Name) else None


def _handler_names(handler: ast.ExceptHandler) -> set[str]:
    kinds = handler.type
    if kinds is None:
        return {"BaseException"}
    items = kinds.elts if isinstance(kinds, ast.Tuple) else [kinds]
    return {item.id for item in items if isinstance(item, ast.Name)}


def _catches(handlers: set[str], name: str) -> bool:
    raised = getattr(builtins, name)
    return any(
        isinstance(getattr(builtins, h, None), type) and issubclass(raised, getattr(builtins, h)) for h in handlers
    )


class _Scan(ast.NodeVisitor):
    def __init__(self, path: str) -> None:
        self.path = path
        self.functions: list[str] = []
        self.caught: list[set[str]] = []
        self.found: list[tuple[str, int, str, str]] = []  # (path, line, function, exception)
        self.classes: list[tuple[str, str, list[str]]] = []

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        self.functions.append(node.name)
        caught, self.caught = self.caught, []  # a try around a def does not catch what the function raises
        self.generic_visit(node)
        self.caught = caught
        self.functions.pop()

    visit_AsyncFunctionDef = visit_FunctionDef  # noqa: N815

    def visit_Try(self, node: ast.Try) -> None:
        names = set().union(*(_handler_names(h) for h in node.handlers)) if node.handlers else set()
        self.caught.append(names)
        for statement in node.body:
            self.visit(statement)
        self.caught.pop()
        for part in (*node.handlers, *node.orelse, *node.finalbody):
            self.visit(part)

    def visit_Raise(self, node: ast.Raise) -> None:
        name = _raised_name(node)
        if name in BUILTIN_EXCEPTIONS and not any(_catches(c, name) for c in self.caught):
            self.found.append((self.path, node.lineno, self.functions[-1] if self.functions else "", name))
        self.generic_visit(node)

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        bases = [b.id if isinstance(b, ast.Name) else ast.unparse(b) for b in node.bases]
        self.classes.append((self.path, node.name, bases))
        self.generic_visit(node)


def _scan() -> list[_Scan]:
    scans = []
    for path in _sources():
        scan = _Scan(str(path.relative_to(ROOT)))
        scan.visit(ast.parse(path.read_text(), filename=str(path)))
        scans.append(scan)
    return scans


def test_no_builtin_exception_reaches_a_user() -> None:
    offenders = [
        f"{path}:{line} in {function or 'module'}(): raise {name}"
        for scan in _scan()
        for path, line, function, name in scan.found
        if name not in ALLOWED_EVERYWHERE and (path, function, name) not in ALLOWED_AT
    ]
    assert not offenders, "raise a FedcoreError subclass (fedcore/errors.py) that says what to do:\n" + "\n".join(
        offenders
    )


def test_the_allowed_list_holds_no_stale_entries() -> None:
    found = {(path, function, name) for scan in _scan() for path, _, function, name in scan.found}
    assert set(ALLOWED_AT) <= found, set(ALLOWED_AT) - found


def test_every_exception_class_is_in_the_tree_or_internal() -> None:
    classes = {name: (path, [b.rsplit(".", 1)[-1] for b in bases]) for scan in _scan() for path, name, bases in
               scan.classes}  # fmt: skip
    tree, exceptions = {"FedcoreError"}, set(BUILTIN_EXCEPTIONS)
    for _ in range(len(classes)):  # a fixed point over the class graph, by name
        for name, (_, bases) in classes.items():
            if any(b in tree for b in bases):
                tree.add(name)
            if any(b in exceptions for b in bases):
                exceptions.add(name)
    outside = [f"{classes[n][0]}: class {n}" for n in sorted(exceptions - tree - BUILTIN_EXCEPTIONS)
               if (classes[n][0], n) not in INTERNAL_CLASSES]  # fmt: skip
    assert not outside, "derive from FedcoreError (fedcore/errors.py):\n" + "\n".join(outside)
    for path, name in INTERNAL_CLASSES:
        assert classes.get(name, ("",))[0] == path, f"{path}: {name} is gone; drop it from INTERNAL_CLASSES"


def test_the_scan_finds_what_it_must() -> None:
    # the scanner itself: a builtin raise outside a try is found, one caught right there is not
    source = (
        "def f(x):\n"
        "    if x:\n"
        "        raise ValueError('bad')\n"
        "    try:\n"
        "        raise TypeError\n"
        "    except TypeError:\n"
        "        pass\n"
        "    try:\n"
        "        raise KeyError(x)\n"
        "    except ValueError:\n"
        "        pass\n"
    )
    scan = _Scan("example.py")
    scan.visit(ast.parse(source))
    assert [(line, name) for _, line, _, name in scan.found] == [(3, "ValueError"), (9, "KeyError")]


def test_converted_raises_say_what_to_do() -> None:
    from fedcore.supervised import SupervisedTask
    from simulations.models import build_model

    with pytest.raises(ConfigError, match="unknown model 'resnet'; choose one of"):
        build_model("resnet", (1, 28, 28), 10)
    with pytest.raises(ConfigError, match="choose model 2nn or logreg"):
        build_model("cnn", (5,), 10)
    task = SupervisedTask(model_fn=lambda: None, train_data=None, test_data=None)  # type: ignore[arg-type,return-value]
    with pytest.raises(ClientTaskError, match="give it train_data"):
        task.training_data()
    assert issubclass(ClientTaskError, FedcoreError) and issubclass(EngineError, FedcoreError)
