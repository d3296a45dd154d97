"""The README's "Your own task" example is complete and runs as the README says: its factory gives each client a
share of its own (disjoint, together the whole training split), and `fedcore simulate --task mytask:make_task`
trains it to well above chance in the README's 5 rounds."""

from __future__ import annotations

import csv
import importlib
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

from fedcore.cli import main
from fedcore.task import TaskContext

README = Path(__file__).resolve().parents[2] / "README.md"


def readme_task(tmp_path: Path) -> Path:
    text = README.read_text(encoding="utf-8")
    begin = text.index("```python\n# mytask.py\n") + len("```python\n")
    module = tmp_path / "mytask.py"
    module.write_text(text[begin : text.index("```", begin)], encoding="utf-8")
    return module


@pytest.fixture
def mytask(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[ModuleType]:
    readme_task(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module("mytask")  # written by readme_task: no module to check statically

    yield module
    sys.modules.pop("mytask", None)


def test_the_readme_factory_gives_each_client_its_own_share(mytask: ModuleType) -> None:
    shares = [
        mytask.make_task(TaskContext(role="client", client_id=f"c{i}", partition_id=i, num_partitions=4, seed=0))
        for i in range(4)
    ]
    xs = [task.train_data[0].numpy() for task in shares]
    assert sum(len(x) for x in xs) == 1500
    rows = np.concatenate(xs)
    assert len(np.unique(rows, axis=0)) == len(np.unique(mytask.load_digits_split(test=False)[0].numpy(), axis=0))
    server = mytask.make_task(TaskContext(role="server", seed=0))
    assert server.train_data is None and len(server.test_data[1]) == 297


def test_the_readme_simulation_command_trains_it(mytask: ModuleType, tmp_path: Path) -> None:
    out = tmp_path / "run"
    code = main(["simulate", "--task", "mytask:make_task", "--clients", "4", "--min-fit-clients", "4", "--rounds",
                 "5", "--out", str(out), "--no-plot", "--no-progress"])  # fmt: skip
    assert code == 0
    with (out / "history.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [int(r["round"]) for r in rows] == [0, 1, 2, 3, 4, 5]
    assert all(int(r["clients"]) == 4 for r in rows[1:])
    assert float(rows[-1]["test_accuracy"]) > 0.5  # 10 classes: chance is 0.1 (0.69 measured)
