"""Task factories the engine tests hand to workers as ``module:attr`` strings (plus a reference trainer)."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable

import numpy as np
import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from fedcore.engine import ParallelPlan, train_with_plan
from fedcore.engine.launch import DEFAULT_TIMEOUT_S
from fedcore.engine.transformer import gpt, lm_loss
from fedcore.seeding import derive_seed
from fedcore.supervised import SupervisedTask
from fedcore.task import EvalResult, FitConfig, TaskContext, TrainResult
from fedcore.tensors import NamedArrays, from_state_dict, to_state_dict
from fedcore.training import train_supervised

FEATURES, CLASSES = 6, 4


def mlp() -> nn.Sequential:
    """Three linear layers; split point "2" cuts it into two stages."""
    return nn.Sequential(nn.Linear(FEATURES, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, CLASSES))


def deep_mlp() -> nn.Sequential:
    """Four blocks (named "0".."3") for four-stage pipelines: split points "1", "2", "3"."""
    width = 12
    return nn.Sequential(
        nn.Sequential(nn.Linear(FEATURES, width), nn.Tanh()),
        nn.Sequential(nn.Linear(width, width), nn.Tanh()),
        nn.Sequential(nn.Linear(width, width), nn.Tanh()),
        nn.Linear(width, CLASSES),
    )


def _data(ctx: TaskContext) -> tuple[torch.Tensor, torch.Tensor]:
    n = int(ctx.options.get("n", "48"))
    gen = torch.Generator().manual_seed(derive_seed(ctx.seed, "data", ctx.client_id))
    x = torch.randn(n, FEATURES, generator=gen)
    y = torch.randint(0, CLASSES, (n,), generator=gen)
    return x, y


def mlp_task(ctx: TaskContext) -> SupervisedTask:
    """A small classifier on random data keyed by (seed, client_id); option ``n`` sets the sample count."""
    return SupervisedTask(model_fn=mlp, train_data=_data(ctx))


def deep_task(ctx: TaskContext) -> SupervisedTask:
    """Like :func:`mlp_task` with the four-block model."""
    return SupervisedTask(model_fn=deep_mlp, train_data=_data(ctx))


def _loss_failing_on_rank1(output: torch.Tensor, target: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    if os.environ.get("RANK") == "1":
        raise RuntimeError("boom on rank 1")
    return nn.functional.cross_entropy(output, target, reduction=reduction)


def crashing_task(ctx: TaskContext) -> SupervisedTask:
    """Trains normally except on rank 1, whose loss function raises."""
    return SupervisedTask(model_fn=mlp, train_data=_data(ctx), loss_fn=_loss_failing_on_rank1)


def _loss_dying_on_rank1(output: torch.Tensor, target: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    if os.environ.get("RANK") == "1":
        time.sleep(0.5)  # rank 0 is waiting in the first gradient all-reduce by then
        if os.environ["FEDCORE_TEST_DEATH"] == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        os._exit(7)
    return nn.functional.cross_entropy(output, target, reduction=reduction)


def dying_task(ctx: TaskContext) -> SupervisedTask:
    """Trains normally except on rank 1, which dies without raising: ``os._exit(7)``, or SIGKILL when the
    environment's ``FEDCORE_TEST_DEATH`` is ``kill``."""
    return SupervisedTask(model_fn=mlp, train_data=_data(ctx), loss_fn=_loss_dying_on_rank1)


def _mean_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(output, target)


def mean_loss_task(ctx: TaskContext) -> SupervisedTask:
    """:func:`mlp_task` with a loss that takes no ``reduction`` argument (always the batch mean)."""
    return SupervisedTask(model_fn=mlp, train_data=_data(ctx), loss_fn=_mean_loss)


def initial_parameters(model_fn: type[nn.Module] | object, seed: int = 0) -> NamedArrays:
    """A global model: ``model_fn()`` initialized under ``torch.manual_seed(seed)``."""
    torch.manual_seed(seed)
    return from_state_dict(model_fn().state_dict())  # type: ignore[operator]


def reference(
    factory: object,
    ctx: TaskContext,
    global_parameters: NamedArrays,
    config: FitConfig,
    *,
    seed: int,
    round: int,
    client_id: str,
) -> tuple[NamedArrays, TrainResult]:
    """Single-device :func:`train_supervised` with the engine's generator: what every plan must reproduce."""
    task = factory(ctx)  # type: ignore[operator]
    model = task.build_model()
    model.load_state_dict(to_state_dict(global_parameters))
    anchors = {n: p.detach().clone() for n, p in model.named_parameters()}
    x, y = task.training_data()
    result = train_supervised(
        model,
        x,
        y,
        config,
        generator=torch.Generator().manual_seed(derive_seed(seed, round, client_id)),
        global_parameters=anchors,
        loss_fn=task.loss_fn,
    )
    return from_state_dict(model.state_dict()), result


def assert_same_state(actual: NamedArrays, expected: NamedArrays, *, atol: float = 1e-5, rtol: float = 1e-5) -> None:
    """Same names in the same order, same dtypes, values equal within float32 rounding."""
    assert list(actual) == list(expected)
    for name in expected:
        assert actual[name].dtype == expected[name].dtype, name
        torch.testing.assert_close(
            torch.from_numpy(np.asarray(actual[name])),
            torch.from_numpy(np.asarray(expected[name])),
            atol=atol,
            rtol=rtol,
        )


def bn_mlp() -> nn.Sequential:
    """Two BatchNorm layers, one on each side of split point "3" (layers "0".."6")."""
    return nn.Sequential(
        nn.Linear(FEATURES, 12),
        nn.BatchNorm1d(12),
        nn.Tanh(),
        nn.Linear(12, 12),
        nn.BatchNorm1d(12, momentum=None),  # cumulative average: num_batches_tracked sets its weight
        nn.Tanh(),
        nn.Linear(12, CLASSES),
    )


def bn_task(ctx: TaskContext) -> SupervisedTask:
    """Like :func:`mlp_task` with the BatchNorm model."""
    return SupervisedTask(model_fn=bn_mlp, train_data=_data(ctx))


class WithUnusedModule(nn.Module):
    """The MLP plus a linear layer that ``forward`` never calls."""

    def __init__(self) -> None:
        super().__init__()
        self.body = mlp()
        self.unused = nn.Linear(CLASSES, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def unused_module_task(ctx: TaskContext) -> SupervisedTask:
    """A task whose model has a module unused in forward (``unused.weight``, ``unused.bias``)."""
    return SupervisedTask(model_fn=WithUnusedModule, train_data=_data(ctx))


def tied_mlp() -> nn.Sequential:
    """Layers "0" and "2" share one weight matrix (tied weights)."""
    model = nn.Sequential(nn.Linear(FEATURES, FEATURES), nn.Tanh(), nn.Linear(FEATURES, FEATURES), nn.Tanh())
    model[2].weight = model[0].weight
    return model


def tied_task(ctx: TaskContext) -> SupervisedTask:
    """A task with tied weights (see :func:`tied_mlp`)."""
    return SupervisedTask(model_fn=tied_mlp, train_data=_data(ctx), loss_fn=_feature_loss)


def reused_mlp() -> nn.Sequential:
    """One ``Linear(FEATURES, FEATURES)`` applied twice, as layers "0" and "2" (a shared layer, one module object),
    then a head "4"."""
    shared = nn.Linear(FEATURES, FEATURES)
    return nn.Sequential(shared, nn.Tanh(), shared, nn.Tanh(), nn.Linear(FEATURES, CLASSES))


def reused_task(ctx: TaskContext) -> SupervisedTask:
    """A task with :func:`reused_mlp`."""
    return SupervisedTask(model_fn=reused_mlp, train_data=_data(ctx))


def _feature_loss(output: torch.Tensor, target: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    return nn.functional.cross_entropy(output[:, :CLASSES], target, reduction=reduction)


def _loss_hanging_on_rank1(output: torch.Tensor, target: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    if os.environ.get("RANK") == "1":
        time.sleep(3600)
    return nn.functional.cross_entropy(output, target, reduction=reduction)


def hanging_task(ctx: TaskContext) -> SupervisedTask:
    """Rank 1 hangs in its first loss; rank 0 then waits for it in the gradient all-reduce."""
    return SupervisedTask(model_fn=mlp, train_data=_data(ctx), loss_fn=_loss_hanging_on_rank1)


def run_plan(
    factory_name: str,
    model_fn: object,
    plan: ParallelPlan,
    *,
    ctx: TaskContext,
    config: FitConfig,
    round: int = 1,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> tuple[NamedArrays, TrainResult]:
    """``train_with_plan`` of this module's factory ``factory_name`` from ``initial_parameters(model_fn)``."""
    return train_with_plan(
        f"{__name__}:{factory_name}",
        ctx,
        initial_parameters(model_fn),
        config,
        plan,
        seed=1,
        round=round,
        client_id="c1",
        timeout_s=timeout_s,
    )


class RunningSum(nn.Module):
    """An identity layer that sums the samples it sees into a buffer (a custom running statistic)."""

    running_sum: torch.Tensor
    calls: torch.Tensor

    def __init__(self, features: int) -> None:
        super().__init__()
        self.register_buffer("running_sum", torch.zeros(features))
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.running_sum += x.detach().sum(0)
            self.calls += 1
        return x


def running_sum_task(ctx: TaskContext) -> SupervisedTask:
    """A linear classifier followed by :class:`RunningSum` (buffers ``1.running_sum``, ``1.calls``)."""
    return SupervisedTask(model_fn=running_sum_model, train_data=_data(ctx))


def running_sum_model() -> nn.Sequential:
    """``Linear(FEATURES, CLASSES)`` then :class:`RunningSum`."""
    return nn.Sequential(nn.Linear(FEATURES, CLASSES), RunningSum(CLASSES))


class OwnLoopTask:
    """A task with its own loop and no engine contract: each round moves every parameter halfway to 1."""

    def build_model(self) -> nn.Module:
        return mlp()

    def train(self, model: nn.Module, config: FitConfig, context: object) -> TrainResult:
        with torch.no_grad():
            for param in model.parameters():
                param.mul_(0.5).add_(0.5)
        return TrainResult(num_examples=7, metrics={"train_loss": 0.25})

    def evaluate(self, model: nn.Module, batch_size: int) -> EvalResult:
        return EvalResult(loss=0.0, num_examples=0)


def own_loop_task(ctx: TaskContext) -> OwnLoopTask:
    """See :class:`OwnLoopTask`."""
    return OwnLoopTask()


class HeadOnlyTask(SupervisedTask):
    """A SupervisedTask whose train() is its own: only the last layer is trained."""

    def train(self, model: nn.Module, config: FitConfig, context: object) -> TrainResult:
        for name, param in model.named_parameters():
            param.requires_grad_(name.startswith("4."))
        return super().train(model, config, context)  # type: ignore[arg-type]


def head_only_task(ctx: TaskContext) -> HeadOnlyTask:
    """See :class:`HeadOnlyTask`."""
    return HeadOnlyTask(model_fn=mlp, train_data=_data(ctx))


VOCAB, SEQ = 32, 8


def tiny_gpt(tied: bool = True) -> nn.Sequential:
    """A two-block GPT (4 heads of width 4) for tensor-parallel tests; split point "blocks.1" needs ``tied=False``."""
    return gpt(vocab=VOCAB, d_model=16, layers=2, heads=4, seq_len=SEQ, tie_embeddings=tied)


def tiny_gpt_untied() -> nn.Sequential:
    """:func:`tiny_gpt` with its own head weight (for FSDP2 and pipeline splits)."""
    return tiny_gpt(tied=False)


def _tokens(ctx: TaskContext) -> tuple[torch.Tensor, torch.Tensor]:
    n = int(ctx.options.get("n", "20"))
    gen = torch.Generator().manual_seed(derive_seed(ctx.seed, "tokens", ctx.client_id))
    text = torch.randint(0, VOCAB, (n, SEQ + 1), generator=gen)
    return text[:, :-1].contiguous(), text[:, 1:].contiguous()


def gpt_task(ctx: TaskContext) -> SupervisedTask:
    """Next-token prediction on random tokens keyed by (seed, client_id) with :func:`tiny_gpt`; option ``tied``
    ("0" for :func:`tiny_gpt_untied`)."""
    return SupervisedTask(model_fn=_gpt_fn(ctx), train_data=_tokens(ctx), loss_fn=lm_loss)


def _gpt_fn(ctx: TaskContext) -> Callable[[], nn.Module]:
    """:func:`tiny_gpt` (option ``tied``: "0" for :func:`tiny_gpt_untied`), probed when option ``probe`` is set."""
    model_fn = tiny_gpt if ctx.options.get("tied", "1") == "1" else tiny_gpt_untied
    probe = ctx.options.get("probe")
    return model_fn if probe is None else lambda: _probed(model_fn(), probe)


def _note(path: str, text: str) -> None:
    """Append ``"<RANK> <text>"`` (``-`` outside a worker) as one line to ``path``."""
    with open(path, "a") as f:
        f.write(f"{os.environ.get('RANK', '-')} {text}\n")


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """What this rank holds of ``tensor``: a DTensor's local shard, a plain tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _probed(model: nn.Sequential, path: str) -> nn.Sequential:
    """Append ``"<RANK> <rows of blocks.0.attn.q's weight held by this rank>"`` to ``path`` at every forward."""
    layer = model.get_submodule("blocks.0.attn.q")

    def record(module: nn.Module, args: object) -> None:
        assert isinstance(module.weight, torch.Tensor)
        _note(path, str(_local(module.weight).shape[0]))

    layer.register_forward_pre_hook(record)
    return model


class HeadsOnlyPlanTask(SupervisedTask):
    """A task that declares its own tensor-parallel plan: only the attention projections are split."""

    def tensor_parallel_plan(self, model: nn.Module, degree: int) -> dict[str, object]:
        styles: dict[str, object] = {}
        blocks = model.get_submodule("blocks")
        assert isinstance(blocks, nn.Sequential)
        for i in range(len(blocks)):
            styles.update({f"blocks.{i}.attn.{n}": ColwiseParallel() for n in ("q", "k", "v")})
            styles[f"blocks.{i}.attn.proj"] = RowwiseParallel()
        return styles


def heads_only_task(ctx: TaskContext) -> HeadsOnlyPlanTask:
    """:func:`gpt_task` with the task's own plan (:class:`HeadsOnlyPlanTask`)."""
    return HeadsOnlyPlanTask(model_fn=_gpt_fn(ctx), train_data=_tokens(ctx), loss_fn=lm_loss)


class InitProbeLinear(nn.Linear):
    """An ``nn.Linear`` that appends ``"<RANK> init meta|real"`` to ``path`` each time it initializes its weights
    (``reset_parameters``): ``real`` is a full-size random initialization with storage, ``meta`` one on the meta
    device (no storage, no cost)."""

    _probe_path: str

    def __init__(self, in_features: int, out_features: int, path: str) -> None:
        object.__setattr__(self, "_probe_path", path)  # reset_parameters runs inside nn.Linear.__init__
        super().__init__(in_features, out_features)

    def reset_parameters(self) -> None:
        _note(self._probe_path, f"init {'meta' if self.weight.is_meta else 'real'}")
        super().reset_parameters()


def probe_mlp(path: str, *, real: bool = False) -> nn.Sequential:
    """``FEATURES -> 16 -> 16 -> CLASSES + 1`` of :class:`InitProbeLinear` (the last layer's 5 rows shard unevenly
    over 2 ranks). Its first forward on each rank appends ``"<RANK> numel <json {name: local numel}>"`` to ``path``:
    the elements each parameter holds on that rank (a DTensor's local shard). ``real`` adds a non-persistent buffer,
    which keeps the engine from building the model on the meta device."""
    model = nn.Sequential(
        InitProbeLinear(FEATURES, 16, path),
        nn.Tanh(),
        InitProbeLinear(16, 16, path),
        nn.Tanh(),
        InitProbeLinear(16, CLASSES + 1, path),
    )
    if real:
        model.register_buffer("scratch", torch.zeros(1), persistent=False)
    recorded: list[bool] = []

    def record(module: nn.Module, args: object, output: object) -> None:
        if recorded:
            return
        recorded.append(True)
        _note(path, f"numel {json.dumps({name: _local(p).numel() for name, p in module.named_parameters()})}")

    model.register_forward_hook(record)
    return model


class ProbeTask(SupervisedTask):
    """:func:`probe_mlp` on :func:`_data`, with a tensor-parallel plan: layer "0" column-wise, "2" row-wise."""

    def tensor_parallel_plan(self, model: nn.Module, degree: int) -> dict[str, object]:
        return {"0": ColwiseParallel(), "2": RowwiseParallel()}


def probe_task(ctx: TaskContext) -> ProbeTask:
    """See :class:`ProbeTask`; options ``probe`` (the file) and ``real`` ("1": not buildable on the meta device)."""
    path, real = ctx.options["probe"], ctx.options.get("real") == "1"
    return ProbeTask(model_fn=lambda: probe_mlp(path, real=real), train_data=_data(ctx))
