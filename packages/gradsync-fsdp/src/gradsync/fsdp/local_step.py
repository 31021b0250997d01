"""The optimizer step on the shards' local tensors.

An element-wise optimizer (Adam, SGD) on DTensor params sends each of its ~10 ops per param through
DTensor's dispatcher, which on CPU costs as much as the math of a small model's step (measured: 34 ms
against 15 ms for the toy GPT's AdamW). The shards' local tensors are views of the flat buffers, so the
same step on them updates the same memory. :func:`local_tensors_for_step` lends the optimizer the local
tensors (params, grads and state) for the duration of a step and gives the DTensors back after it, state
created during the step included.

A param whose shard is empty on this rank (ragged shards leave most of a small unit's params on one rank)
is not lent when a param of its group with elements here steps beside it: torch's element-wise
optimizers cost tens of microseconds per param even on no elements (measured: 3.3 ms per Adam step for
170 empty params), and a step changes nothing of an empty param but its scalar state (step counts, NAdam's
momentum product, ASGD's eta and mu), which in those optimizers is a function of the group's
hyperparameters and the number of steps alone (every param of a group gets a grad at every step:
MegatronFSDP attaches one to each). So it takes that state from the param stepped beside it, and its
per-element state is created empty, as the step would have; a checkpoint reads the same state from every
rank.

Lending param by param costs tens of microseconds per param (most of it hashing tensors into the state
mapping), so after a step that leaves every state dict, state tensor and grad as it found them, the next
step swaps in a second mapping kept from the last (the lent params' entries under their locals) and
swaps the callers' back after it; anything replaced in between, or created by the step, goes the param by
param way.

``fully_shard_optimizer`` lends them around every step. An optimizer built by hand on the DTensor params
(the fsdp2 API's users build torch's own, as with torch's ``fully_shard``) is adopted at its first step
(:mod:`gradsync.fsdp.optimizer_facing`): its later steps are wrapped the same way, for torch's element-wise
optimizers only (a matrix optimizer on the locals would see shards for whole matrices). Wrapped, not
hooked: the DTensors must go back even when the step raises, and torch skips an optimizer's post-step
hooks then, which would leave it holding the locals.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import operator
import types
from collections.abc import Iterator
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from gradsync.buffers.torch_internals import local_tensor

from .ragged import RaggedDTensor


def _as_distributed(value: Any, param: DTensor, local: torch.Tensor) -> Any:
    """State the step created: per-element tensors become DTensors split like ``param`` (ragged too)."""
    if not (isinstance(value, torch.Tensor) and value.shape == local.shape and value.dim() > 0):
        return value
    if isinstance(param, RaggedDTensor):
        return param.like(value)
    return DTensor.from_local(
        value, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
    )


class _Lent:
    """One DTensor param lent as its local tensor: the state dicts on both sides, kept between steps so
    a step whose state the optimizer updated in place (Adam, SGD with momentum) rebuilds nothing."""

    __slots__ = ("local", "local_state", "param", "state")

    def __init__(self, param: DTensor) -> None:
        self.param, self.local = param, local_tensor(param)
        self.state: dict[str, Any] = {}  # the param's state as the optimizer holds it between steps
        self.local_state: dict[str, Any] = {}  # the same, locals, as lent in the last step

    def lend(self, optimizer: torch.optim.Optimizer) -> None:
        grad = self.param.grad
        local_grad = local_tensor(grad)
        if self.local.grad is not local_grad:
            self.local.grad = local_grad
        state = optimizer.state.pop(self.param, None)
        if state is None:
            self.state, self.local_state = {}, {}
            return
        if (
            state is not self.state
            or len(state) != len(self.local_state)
            or any(local_tensor(value) is not self.local_state.get(key) for key, value in state.items())
        ):
            self.state, self.local_state = state, {key: local_tensor(value) for key, value in state.items()}
        optimizer.state[self.local] = self.local_state

    def give_back(self, optimizer: torch.optim.Optimizer) -> None:
        local_state = optimizer.state.pop(self.local, None)
        if local_state is not None:
            if local_state is not self.local_state:  # created by the step
                self.state, self.local_state = {}, local_state
            for key, value in local_state.items():
                if local_tensor(self.state.get(key)) is not value:  # created or replaced by the step
                    self.state[key] = _as_distributed(value, self.param, self.local)
        if self.state:
            optimizer.state[self.param] = self.state

    def follow(self, optimizer: torch.optim.Optimizer, stepped: _Lent) -> None:
        """Take the state a step gave ``stepped``, a param of this one's group, as this param's (its shard
        is empty here): scalar state copied, per-element state created empty where missing."""
        source = optimizer.state.get(stepped.param)
        if not source:
            return
        state = optimizer.state.setdefault(self.param, {})
        for key, value in source.items():
            if isinstance(value, DTensor):
                if key not in state:
                    empty = self.local.new_empty(self.local.shape, dtype=value.dtype)
                    state[key] = _as_distributed(empty, self.param, self.local)
            elif isinstance(value, torch.Tensor):
                mine = state.get(key)
                same = isinstance(mine, torch.Tensor) and not isinstance(mine, DTensor)
                if same and (mine.shape, mine.dtype, mine.device) == (value.shape, value.dtype, value.device):
                    mine.copy_(value)
                else:
                    state[key] = value.clone()
            else:
                state[key] = value


class _ScalarCopies:
    """The copies that bring a group's empty params' scalar state to the leader's after a step, planned
    once and made in one foreach call while every state dict involved holds the tensors it held then (an
    in-place step, as torch's, keeps them; anything else plans them again)."""

    __slots__ = ("dicts", "followers", "mines", "source", "source_values", "sources", "values")

    def __init__(
        self, optimizer: torch.optim.Optimizer, source: dict[str, Any], followers: list[_Lent]
    ) -> None:
        self.source, self.source_values, self.followers = source, list(source.values()), followers
        self.dicts: list[dict[str, Any]] = [optimizer.state[f.param] for f in followers]
        self.values = [list(state.values()) for state in self.dicts]
        scalars = [
            (k, v) for k, v in source.items() if isinstance(v, torch.Tensor) and not isinstance(v, DTensor)
        ]
        self.mines = [state[key] for state in self.dicts for key, _ in scalars]
        self.sources = [value for _ in self.dicts for _, value in scalars]

    @staticmethod
    def possible(source: dict[str, Any]) -> bool:
        """Only tensors can be copied in place (a Python number in the state is set anew each step)."""
        return all(isinstance(value, torch.Tensor) for value in source.values())

    def hold(self, optimizer: torch.optim.Optimizer, source: dict[str, Any], followers: list[_Lent]) -> bool:
        return (
            source is self.source
            and len(source) == len(self.source_values)
            and all(map(operator.is_, source.values(), self.source_values))
            and len(followers) == len(self.followers)
            and all(map(operator.is_, followers, self.followers))
            and all(map(operator.is_, (optimizer.state.get(f.param) for f in followers), self.dicts))
            and all(
                all(map(operator.is_, state.values(), values))
                for state, values in zip(self.dicts, self.values, strict=True)
            )
        )


class _Group:
    """One param group with DTensors, as a step lends it."""

    __slots__ = (
        "copies",
        "dict",
        "followers",
        "locals",
        "originals",
        "own",
        "params",
        "stepped",
        "stepped_locals",
    )

    def __init__(self, group: dict[str, Any], lent: dict[int, _Lent], skip_empty: bool) -> None:
        self.dict, self.params = group, group["params"]  # the list itself: put back after a step
        self.originals = list(self.params)
        self.locals = [lent[id(p)].local if isinstance(p, DTensor) else p for p in self.originals]
        own = list({id(p): lent[id(p)] for p in self.originals if isinstance(p, DTensor)}.values())
        self.own = own  # every DTensor param of the group, lent
        self.followers = [x for x in own if skip_empty and x.local.numel() == 0]
        self.stepped = [x for x in own if x not in self.followers]
        self.stepped_locals = [t for t in self.locals if not any(t is f.local for f in self.followers)]
        self.copies: _ScalarCopies | None = None

    def follow(self, optimizer: torch.optim.Optimizer, leader: _Lent, *, unchanged: bool) -> None:
        """After a step: the empty params that had a grad take ``leader``'s state (:meth:`_Lent.follow`),
        by the planned copies where they still hold (``unchanged``: no state or grad was replaced since
        they were planned, so they do)."""
        copies = self.copies
        if not unchanged or copies is None:
            followers = [f for f in self.followers if f.param.grad is not None]  # a step skips the others
            source = optimizer.state.get(leader.param)
            if not source:
                return
            if copies is None or not copies.hold(optimizer, source, followers):
                for follower in followers:
                    follower.follow(optimizer, leader)
                self.copies = (
                    _ScalarCopies(optimizer, source, followers) if _ScalarCopies.possible(source) else None
                )
                return
        if copies.mines:  # SGD keeps no scalar state
            torch._foreach_copy_(copies.mines, copies.sources)

    def leader(self) -> _Lent | None:
        """A param with elements here that this step updates (one with a grad), which the empty ones
        follow; None: they are stepped themselves."""
        if self.followers:
            for candidate in self.stepped:
                if candidate.param.grad is not None:
                    return candidate
        return None


def _same(these: list[Any], those: list[Any]) -> bool:
    return len(these) == len(those) and all(map(operator.is_, these, those))


def _values(dicts: list[dict[str, Any]]) -> list[Any]:
    return list(itertools.chain.from_iterable(map(dict.values, dicts)))


def _entries(state: dict[Any, dict[str, Any]]) -> tuple[list[Any], list[Any], list[Any]]:
    """An optimizer state mapping's keys, its per-param dicts and every value in them, in order."""
    dicts = list(state.values())
    return list(state), dicts, _values(dicts)


def _unchanged(state: dict[Any, dict[str, Any]], entries: tuple[list[Any], list[Any], list[Any]]) -> bool:
    keys, dicts, values = entries
    return _same(list(state), keys) and _same(list(state.values()), dicts) and _same(_values(dicts), values)


class _Swap:
    """The optimizer's state as the last step left it, both ways round: ``user`` as callers see it (the
    DTensor params' state) and ``step``, the same mapping with each lent param's entry under its local
    tensor, holding the locals. While nothing has replaced the mapping, a state dict, a state tensor or a
    grad since, the next step swaps the whole mapping in and out instead of lending param by param, which
    costs tens of microseconds per param (on a launch-bound model, most of what lending costs)."""

    def __init__(self, optimizer: torch.optim.Optimizer, lent: list[_Lent]) -> None:
        self.lent, self.user, self.grads = lent, optimizer.state, self._grads(lent)
        by_param = {id(x.param): x for x in lent}
        step: collections.defaultdict[Any, Any] = collections.defaultdict(dict)
        for key, value in self.user.items():
            x = by_param.get(id(key))
            if x is None:
                step[key] = value
            else:  # its lend put these locals in the optimizer for the step, and the step kept them
                step[x.local] = x.local_state
        self.step = step
        self.user_entries, self.step_entries = _entries(self.user), _entries(step)

    @staticmethod
    def _grads(lent: list[_Lent]) -> list[Any]:
        """The params' grads (their locals' are set by :meth:`_Lent.lend` only)."""
        return [x.param.grad for x in lent]

    def holds(self, optimizer: torch.optim.Optimizer, lent: list[_Lent]) -> bool:
        return (
            optimizer.state is self.user
            and _same(lent, self.lent)
            and _same(self._grads(lent), self.grads)
            and _unchanged(self.user, self.user_entries)
        )

    def swap_in(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.state = self.step

    def swap_out(self, optimizer: torch.optim.Optimizer) -> bool:
        """Put the callers' mapping back; False when the step created or replaced state, which is then
        where :meth:`_Lent.give_back` expects it (the step's entries in the callers' mapping)."""
        optimizer.state = self.user
        if _unchanged(self.step, self.step_entries):
            return True
        for x in self.lent:
            self.user.pop(x.param, None)
        self.user.update(self.step)
        return False


class _Lending:
    """What a step on ``optimizer`` lends: per param group with DTensors, the group, its params and their
    locals. Built once; rebuilt when a group's params are no longer the ones it was built for."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.groups: list[_Group] = []
        lent: dict[int, _Lent] = {}
        skip_empty = type(optimizer) in ELEMENTWISE  # their scalar state depends on no param's values
        for group in optimizer.param_groups:
            originals = group["params"]
            if any(isinstance(p, DTensor) for p in originals):
                for param in originals:
                    if isinstance(param, DTensor) and id(param) not in lent:
                        lent[id(param)] = _Lent(param)
                self.groups.append(_Group(group, lent, skip_empty))
        self.lent = list(lent.values())
        self.shape = self._shape(optimizer)
        self.swap: _Swap | None = None  # what the last step left, when it can be swapped in whole

    @staticmethod
    def _shape(optimizer: torch.optim.Optimizer) -> list[Any]:
        """The groups and their param lists: ``load_state_dict`` builds new groups over the same lists."""
        return [item for group in optimizer.param_groups for item in (group, group["params"])]

    def current(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether the optimizer still holds exactly these params, with these local tensors."""
        return (
            all(map(operator.is_, self._shape(optimizer), self.shape))
            and len(optimizer.param_groups) * 2 == len(self.shape)
            and all(
                len(group.dict["params"]) == len(group.originals)
                and all(map(operator.is_, group.dict["params"], group.originals))
                for group in self.groups
            )
            and all(local_tensor(lent.param) is lent.local for lent in self.lent)
        )


_LENDING = "_gradsync_lending"


@contextlib.contextmanager
def local_tensors_for_step(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """Within the block, ``optimizer`` holds the local tensors of its DTensor params, their grads and
    their state; after it (even on an error), the DTensors again, with any state the step added."""
    lending = optimizer.__dict__.get(_LENDING)
    if lending is None or not lending.current(optimizer):
        lending = _Lending(optimizer)
        optimizer.__dict__[_LENDING] = lending
    leaders = [group.leader() for group in lending.groups]
    lent = [
        x
        for group, leader in zip(lending.groups, leaders, strict=True)
        for x in (group.stepped if leader is not None else group.own)
    ]
    swap, lending.swap = lending.swap, None  # kept only if the step leaves it valid
    if swap is not None and not swap.holds(optimizer, lent):
        swap = None
    try:
        if swap is not None:
            swap.swap_in(optimizer)
        else:
            for x in lent:
                x.lend(optimizer)
        for group, leader in zip(lending.groups, leaders, strict=True):
            group.dict["params"] = group.locals if leader is None else group.stepped_locals
        yield
    finally:
        for group in lending.groups:
            group.dict["params"] = group.params
        if swap is not None and not swap.swap_out(optimizer):
            swap = None
        if swap is None:
            for x in lent:
                x.give_back(optimizer)
    for group, leader in zip(lending.groups, leaders, strict=True):
        if leader is not None:
            group.follow(optimizer, leader, unchanged=swap is not None)
    lending.swap = swap if swap is not None else _Swap(optimizer, lent)


def split_state_as_params(optimizer: torch.optim.Optimizer) -> None:
    """Give state that torch's ops built as plain DTensors (a torch that runs a DTensor subclass's ops in
    C++, 2.11, drops a :class:`RaggedDTensor`'s split from their outputs) its param's split, so it gathers
    and checkpoints as the param does. Run after every step of an optimizer holding MegatronFSDP's params
    (:mod:`gradsync.fsdp.optimizer_facing`), the materialising step of ``fully_shard_optimizer`` included."""
    for param, state in optimizer.state.items():
        if not isinstance(param, RaggedDTensor):
            continue
        for key, value in state.items():
            if (
                type(value) is DTensor
                and value.shape == param.shape
                and local_tensor(value).shape == local_tensor(param).shape
            ):
                state[key] = param.like(local_tensor(value))


LENDING_ATTR = "_gradsync_steps_on_locals"
"""On an optimizer once decided: True when its steps run within :func:`local_tensors_for_step`."""

ELEMENTWISE = (
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adamax,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.Adagrad,
    torch.optim.Adadelta,
    torch.optim.RMSprop,
    torch.optim.ASGD,
)
"""torch's optimizers whose update of each element reads only that element's param, grad and state."""


def step_on_local_tensors(optimizer: torch.optim.Optimizer) -> None:
    """Wrap ``optimizer.step`` (whatever it is now: an LR scheduler may have wrapped it already) so each
    step runs on the local tensors. A bound method, as LR schedulers built later expect."""
    previous = optimizer.step

    def step(self: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        with local_tensors_for_step(self):
            return previous(*args, **kwargs)

    # the mark of a scheduler's wrapper stays visible, or the scheduler warns that step was replaced
    step.__dict__.update(getattr(previous, "__dict__", {}))
    optimizer.step = types.MethodType(step, optimizer)  # type: ignore[method-assign]
    setattr(optimizer, LENDING_ATTR, True)


def adopt_for_local_steps(optimizer: torch.optim.Optimizer) -> None:
    """Decided once per optimizer, at its first step on MegatronFSDP's params: torch's element-wise
    optimizers run their later steps on the local tensors."""
    if hasattr(optimizer, LENDING_ATTR):
        return
    if type(optimizer) in ELEMENTWISE:
        step_on_local_tensors(optimizer)
    else:
        setattr(optimizer, LENDING_ATTR, False)
