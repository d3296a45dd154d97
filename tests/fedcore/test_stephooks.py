"""Step pre-handlers (fedcore.stephooks): applied to the optimizers of their parameters only, once per step, in their
order, and added and removed by clients in threads while other threads step, which torch's own global hooks do not
survive (``OrderedDict mutated during iteration``, seen as a SCAFFOLD client's failure in a CI run)."""

from __future__ import annotations

import threading
import time

import torch

from fedcore import stephooks
from fedcore.stephooks import CORRECTION_ORDER, PRIVACY_ORDER, step_pre_handler


def test_handlers_run_once_a_step_for_their_parameters_in_their_order_and_go_away() -> None:
    a, b = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(3))
    other = torch.nn.Parameter(torch.ones(1))
    calls: list[str] = []
    opt = torch.optim.SGD([a, b], lr=0.5)
    other_opt = torch.optim.SGD([other], lr=0.5)

    def add_one(optimizer: torch.optim.Optimizer) -> None:  # a correction: +1 on every gradient
        calls.append("correction")
        for group in optimizer.param_groups:
            for p in group["params"]:
                p.grad.add_(1.0)

    def halve(optimizer: torch.optim.Optimizer) -> None:  # stands in for privatizing: runs first
        calls.append("privacy")
        for group in optimizer.param_groups:
            for p in group["params"]:
                p.grad.mul_(0.5)

    with step_pre_handler([a, b], add_one, CORRECTION_ORDER), step_pre_handler([a], halve, PRIVACY_ORDER):
        for p in (a, b, other):
            p.grad = torch.full_like(p, 4.0)
        opt.step()
        other_opt.step()
    assert calls == ["privacy", "correction"]  # once each, for one step of an optimizer holding both parameters
    # gradient 4 -> halved 2 -> plus 1 = 3; lr 0.5: 1 - 1.5 = -0.5 (the other optimizer: 1 - 0.5 * 4 = -1)
    assert a.tolist() == [-0.5, -0.5] and b.tolist() == [-0.5, -0.5, -0.5] and other.tolist() == [-1.0]
    assert not stephooks._handlers
    calls.clear()
    opt.step()
    assert calls == []


def test_clients_in_threads_add_and_remove_handlers_while_others_step() -> None:
    errors: list[BaseException] = []
    threads = 8
    barrier = threading.Barrier(threads)

    def client(k: int) -> None:
        try:
            model = torch.nn.Linear(4, 2)
            seen = 0

            def count(optimizer: torch.optim.Optimizer) -> None:
                nonlocal seen
                seen += 1
                time.sleep(0)  # lets another thread run mid-step, as a handler's torch kernels do

            barrier.wait()
            for _ in range(200):
                opt = torch.optim.SGD(model.parameters(), lr=0.01)
                with step_pre_handler(model.parameters(), count, CORRECTION_ORDER):
                    for _ in range(3):
                        model(torch.ones(1, 4)).sum().backward()
                        opt.step()
                        opt.zero_grad()
            assert seen == 600, f"client {k} saw {seen} steps"
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    workers = [threading.Thread(target=client, args=(k,)) for k in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    assert errors == []
    assert not stephooks._handlers
