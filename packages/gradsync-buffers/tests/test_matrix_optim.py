"""Muon and BlockShampoo (gradsync.buffers.matrix_optim), each checked against a reference computed
another way: Newton-Schulz against the SVD, Muon against its formula applied to singular values,
AdamW groups against torch.optim.AdamW, BlockShampoo against per-tile loops over torch.linalg.eigh, and
sharded runs (row pieces, DTensors on 2 gloo ranks) against the optimizer on whole plain tensors."""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from buffers_testkit import device
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard

from gradsync.buffers import BlockShampoo, Muon, muon_param_groups
from gradsync.buffers.checkpointing import contiguous_stride, describe_chunk, materialize_optimizer_state
from gradsync.buffers.matrix_optim import inverse_fourth_root, newton_schulz
from gradsync.buffers.torch_internals import local_tensor
from gradsync.groups.testing import run_distributed

QUINTIC = (3.4445, -4.7750, 2.0315)  # Muon's published Newton-Schulz coefficients
NS_BAND = (0.68, 1.21)  # where 5 quintic steps leave singular values above 1/500 of the Frobenius norm


def reference_orthogonalise(matrix: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """Newton-Schulz through the SVD, in float64: the quintic applied to each normalised singular value."""
    u, s, vh = torch.linalg.svd(matrix.double(), full_matrices=False)
    x = s / (torch.linalg.matrix_norm(matrix.double()) + 1e-7)
    a, b, c = QUINTIC
    for _ in range(steps):
        x = a * x + b * x**3 + c * x**5
    return (u * x) @ vh


def random_with_spectrum(rows: int, cols: int, low: float) -> torch.Tensor:
    """A random matrix whose singular values spread over [low, 1]."""
    k = min(rows, cols)
    u, _ = torch.linalg.qr(torch.randn(rows, k, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(cols, k, dtype=torch.float64))
    s = torch.linspace(low, 1.0, k, dtype=torch.float64)
    return ((u * s) @ v.mT).float()


@pytest.mark.parametrize(
    ("shape", "low"), [((32, 64), None), ((64, 32), None), ((128, 8), None), ((48, 48), 0.05)]
)
def test_newton_schulz_is_the_polar_factor_up_to_its_band(shape: tuple[int, int], low: float | None) -> None:
    torch.manual_seed(0)
    matrix = torch.randn(shape) if low is None else random_with_spectrum(*shape, low)
    result = newton_schulz(matrix.to(device())).cpu().double()
    u, _, vh = torch.linalg.svd(matrix.double(), full_matrices=False)
    core = u.mT @ result @ vh.mT  # diagonal when the result shares the singular vectors
    diagonal = core.diagonal()
    assert (core - torch.diag(diagonal)).abs().max() < 1e-4
    assert NS_BAND[0] <= diagonal.min(), diagonal
    assert diagonal.max() <= NS_BAND[1], diagonal
    assert torch.linalg.matrix_norm(result - u @ vh, ord=2) <= 0.33  # within the band of U V^T
    torch.testing.assert_close(result, reference_orthogonalise(matrix), rtol=0, atol=2e-5)


class Small(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 6)
        self.conv = nn.Conv1d(6, 5, 3)  # a 3-D weight: orthogonalised as (5, 18)
        self.hidden = nn.Linear(5, 8)
        self.lm_head = nn.Linear(8, 10, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens).transpose(1, 2)
        x = torch.tanh(self.conv(x)).mean(-1)
        return self.lm_head(torch.tanh(self.hidden(x)))


def backward(model: Small, seed: int) -> None:
    torch.manual_seed(seed)
    model.zero_grad()
    tokens = torch.randint(0, 10, (4, 7), device=device())
    targets = torch.randint(0, 10, (4,), device=device())
    nn.functional.cross_entropy(model(tokens), targets).backward()


def test_muon_param_groups_split_hidden_matrices_from_the_rest() -> None:
    model = Small()
    hidden, rest = muon_param_groups(model)
    assert hidden["use_muon"]
    assert not rest["use_muon"]
    assert hidden["params"] == [model.conv.weight, model.hidden.weight]
    assert rest["params"] == [model.embed.weight, model.conv.bias, model.hidden.bias, model.lm_head.weight]
    model.hidden.weight.is_embedding_or_output_parameter = True  # type: ignore[attr-defined]
    assert muon_param_groups(model.named_parameters())[0]["params"] == [model.conv.weight]


@pytest.mark.parametrize("nesterov", [True, False])
def test_one_muon_step_is_the_moonlight_formula(nesterov: bool) -> None:
    torch.manual_seed(0)
    model = Small().to(device())
    lr, momentum, decay = 0.01, 0.9, 0.1
    opt = Muon(muon_param_groups(model), lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=decay)
    matrices = [model.conv.weight, model.hidden.weight]
    weights = [p.detach().double().clone() for p in matrices]
    buffers = [torch.zeros_like(w) for w in weights]
    for seed in range(3):
        backward(model, seed)
        for weight, buffer, param in zip(weights, buffers, matrices, strict=True):
            grad = param.grad.detach().double().reshape(param.shape[0], -1)  # type: ignore[union-attr]
            buffer.view(grad.shape).mul_(momentum).add_(grad)
            direction = grad + momentum * buffer.view(grad.shape) if nesterov else buffer.view(grad.shape)
            scale = 0.2 * math.sqrt(max(grad.shape))
            update = reference_orthogonalise(direction).view(weight.shape)
            weight.mul_(1 - lr * decay).sub_(lr * scale * update)
        opt.step()
        for weight, param in zip(weights, matrices, strict=True):
            torch.testing.assert_close(param.detach().double(), weight, rtol=1e-5, atol=1e-6)
    assert opt.state[model.hidden.weight]["momentum_buffer"].shape == model.hidden.weight.shape


def test_adamw_groups_equal_torch_adamw_exactly() -> None:
    torch.manual_seed(0)
    model = Small().to(device())
    twin = copy.deepcopy(model)
    betas, eps, lr, decay = (0.8, 0.9), 1e-6, 0.01, 0.05
    ours = Muon(muon_param_groups(model), lr=lr, weight_decay=decay, adamw_betas=betas, adamw_eps=eps)
    theirs = torch.optim.AdamW(
        muon_param_groups(twin)[1]["params"], lr=lr, betas=betas, eps=eps, weight_decay=decay, foreach=False
    )
    for seed in range(3):
        with torch.no_grad():  # the hidden matrices take Muon: give the twin the same ones
            twin.conv.weight.copy_(model.conv.weight)
            twin.hidden.weight.copy_(model.hidden.weight)
        backward(model, seed)
        backward(twin, seed)
        ours.step()
        theirs.step()
        for mine, reference in zip(
            muon_param_groups(model)[1]["params"], theirs.param_groups[0]["params"], strict=True
        ):
            assert torch.equal(mine, reference)
            for key in ("exp_avg", "exp_avg_sq", "step"):
                assert torch.equal(ours.state[mine][key], theirs.state[reference][key])


def test_muon_refuses_vectors_in_a_muon_group() -> None:
    with pytest.raises(ValueError, match=r"param 1 of shape \(4,\) is not a matrix.*use_muon=False"):
        Muon([torch.zeros(4, 4, requires_grad=True), torch.zeros(4, requires_grad=True)])


def test_bf16_params_keep_fp32_state_and_math() -> None:
    torch.manual_seed(0)
    weight = torch.randn(6, 4, device=device())
    grads = [torch.randn(6, 4, device=device()) for _ in range(2)]
    fp32 = nn.Parameter(weight.bfloat16().float())
    bf16 = nn.Parameter(weight.bfloat16())
    for factory in (
        lambda p: Muon([p], lr=0.05, weight_decay=0.5),
        lambda p: BlockShampoo([p], lr=0.05, block_size=(4, 3), weight_decay=0.5),
    ):
        reference, ours = factory(fp32), factory(bf16)
        for grad in grads:
            fp32.grad, bf16.grad = grad.bfloat16().float(), grad.bfloat16()
            reference.step()
            fp32.data = fp32.data.bfloat16().float()  # the bf16 param is rounded after each step
            ours.step()
            assert torch.equal(bf16.float(), fp32.detach())
        assert all(v.dtype == torch.float32 for v in ours.state[bf16].values())


# --- BlockShampoo ------------------------------------------------------------------------------------


def test_inverse_fourth_root_is_the_matrix_root() -> None:
    torch.manual_seed(0)
    x = torch.randn(3, 5, 7, dtype=torch.float64)
    stats = x @ x.mT
    root = inverse_fourth_root(stats, 1e-3)
    torch.testing.assert_close(torch.linalg.matrix_power(root, -4), stats + 1e-3 * torch.eye(5))


def reference_shampoo(
    weight: torch.Tensor,
    grads: Sequence[torch.Tensor],
    block: tuple[int, int],
    lr: float,
    betas: tuple[float, float],
    eps: float,
    decay: float,
    frequency: int,
    grafting: bool,
) -> torch.Tensor:
    """The documented formulas, tile by tile in float64 loops over a (rows, cols) matrix view."""
    rows = weight.shape[0] if weight.dim() >= 2 else 1
    w = weight.double().reshape(rows, -1).clone()
    (b1, b2), (r, c) = betas, block
    m, v = torch.zeros_like(w), torch.zeros_like(w)
    stats: dict[tuple[int, int], list[torch.Tensor]] = {}

    def root(matrix: torch.Tensor) -> torch.Tensor:
        values, vectors = torch.linalg.eigh(matrix)
        return vectors @ torch.diag((values.clamp(min=0) + eps) ** -0.25) @ vectors.T

    for t, grad in enumerate(grads, 1):
        g = grad.double().reshape(w.shape)
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        m_hat = m / (1 - b1**t)
        adam = m_hat / ((v / (1 - b2**t)).sqrt() + 1e-8)
        update = torch.zeros_like(w)
        for i in range(0, rows, r):
            for j in range(0, w.shape[1], c):
                tile = (slice(i, i + r), slice(j, j + c))
                gt = g[tile]
                left, right, left_root, right_root = stats.setdefault(
                    (i, j), [torch.zeros(gt.shape[0], gt.shape[0]), torch.zeros(gt.shape[1], gt.shape[1])] * 2
                )
                left = b2 * left + (1 - b2) * gt @ gt.T
                right = b2 * right + (1 - b2) * gt.T @ gt
                if (t - 1) % frequency == 0:
                    left_root, right_root = root(left / (1 - b2**t)), root(right / (1 - b2**t))
                stats[(i, j)] = [left, right, left_root, right_root]
                direction = left_root @ m_hat[tile] @ right_root
                if grafting:
                    direction *= torch.linalg.matrix_norm(adam[tile]) / torch.linalg.matrix_norm(direction)
                update[tile] = direction
        w = w * (1 - lr * decay) - lr * update
    return w.reshape(weight.shape)


@pytest.mark.parametrize("shape", [(10, 7), (7,), (3, 2, 5)])
@pytest.mark.parametrize(("grafting", "frequency"), [("adam", 1), ("none", 1), ("adam", 2)])
def test_block_shampoo_tiles_are_direct_eigh_computations(
    shape: tuple[int, ...], grafting: str, frequency: int
) -> None:
    torch.manual_seed(0)
    weight = torch.randn(shape)
    grads = [torch.randn(shape) for _ in range(4)]
    kwargs: dict[str, Any] = {"lr": 0.01, "betas": (0.9, 0.95), "eps": 1e-3, "weight_decay": 0.1}
    param = nn.Parameter(weight.to(device(), copy=True))
    opt = BlockShampoo(
        [param], block_size=(4, 3), precondition_frequency=frequency, **kwargs, grafting=grafting
    )
    for grad in grads:
        param.grad = grad.to(device())
        opt.step()
    expected = reference_shampoo(
        weight,
        grads,
        (4, 3),
        frequency=frequency,
        grafting=grafting == "adam",
        decay=0.1,
        lr=0.01,
        betas=(0.9, 0.95),
        eps=1e-3,
    )
    torch.testing.assert_close(param.detach().cpu().double(), expected, rtol=1e-5, atol=1e-6)
    rows, cols = (shape[0], math.prod(shape[1:])) if len(shape) > 1 else (1, shape[0])
    r, c = min(4, rows), min(3, cols)  # a block larger than the matrix is clipped to it
    tiles = (math.ceil(rows / r), math.ceil(cols / c))
    assert opt.state[param]["L"].shape == (*tiles, r, r)
    assert opt.state[param]["R_inv_root"].shape == (*tiles, c, c)


def run_shampoo(params: list[nn.Parameter], grads: list[list[torch.Tensor]], **kwargs: Any) -> None:
    opt = BlockShampoo(params, **kwargs)
    for step_grads in grads:
        for param, grad in zip(params, step_grads, strict=True):
            param.grad = grad
        opt.step()


@pytest.mark.parametrize(("shape", "cut"), [((12, 7), 8), ((10,), 6), ((6, 2, 3), 4)])
def test_block_shampoo_on_whole_tiles_equals_block_shampoo_on_the_whole(
    shape: tuple[int, ...], cut: int
) -> None:
    """Two optimizers, each holding half of the tile rows (columns for a 1-D param), step like one
    optimizer on the whole param: the property sharded training relies on."""
    torch.manual_seed(0)
    weight = torch.randn(shape, device=device())
    grads = [torch.randn(shape, device=device()) for _ in range(3)]
    kwargs: dict[str, Any] = {"lr": 0.01, "block_size": (4, 3), "eps": 1e-6}
    whole = nn.Parameter(weight.clone())
    run_shampoo([whole], [[g] for g in grads], **kwargs)
    pieces = [nn.Parameter(weight[:cut].clone()), nn.Parameter(weight[cut:].clone())]
    for index, piece in enumerate(pieces):
        run_shampoo([piece], [[g[:cut] if index == 0 else g[cut:]] for g in grads], **kwargs)
    torch.testing.assert_close(torch.cat([p.detach() for p in pieces]), whole.detach(), rtol=1e-6, atol=1e-7)


# --- rebuilding and checkpoints ----------------------------------------------------------------------

OPTIMIZERS: list[Callable[[list[dict[str, Any]]], torch.optim.Optimizer]] = [
    lambda groups: Muon(groups, lr=0.01, momentum=0.8, weight_decay=0.1, ns_dtype=torch.float64),
    lambda groups: BlockShampoo(groups, lr=0.01, block_size=(4, 3), precondition_frequency=2),
]


def step_all(opt: torch.optim.Optimizer, params: list[nn.Parameter], seed: int) -> None:
    torch.manual_seed(seed)
    for param in params:
        param.grad = torch.randn(param.shape, device=device()).to(param.dtype)
    opt.step()


@pytest.mark.parametrize("make", OPTIMIZERS, ids=["muon", "shampoo"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rebuilt_from_defaults_and_state_dict_steps_the_same(
    make: Callable[[list[dict[str, Any]]], torch.optim.Optimizer], dtype: torch.dtype
) -> None:
    torch.manual_seed(0)
    shapes = [(6, 5), (3, 2, 4), (7,)]
    params = [nn.Parameter(torch.randn(s, device=device()).to(dtype)) for s in shapes]
    opt = make([{"params": params[:2]}, {"params": params[2:], "use_muon": False, "lr": 0.02}])
    for seed in range(3):
        step_all(opt, params, seed)
    saved = copy.deepcopy(opt.state_dict())
    twins = [nn.Parameter(p.detach().clone()) for p in params]
    groups = [{**g, "params": twins[:2] if i == 0 else twins[2:]} for i, g in enumerate(opt.param_groups)]
    rebuilt = type(opt)(groups, **opt.defaults)
    rebuilt.load_state_dict(saved)
    assert [{k: v for k, v in g.items() if k != "params"} for g in rebuilt.param_groups] == [
        {k: v for k, v in g.items() if k != "params"} for g in opt.param_groups
    ]
    for twin in twins:
        assert all(v.dtype == torch.float32 for v in rebuilt.state[twin].values())
    for seed in range(3, 5):
        step_all(opt, params, seed)
        step_all(rebuilt, twins, seed)
    for param, twin in zip(params, twins, strict=True):
        assert torch.equal(param, twin)


# --- DTensor shards on 2 ranks -----------------------------------------------------------------------

PLACEMENTS: dict[str, list[Placement]] = {
    "shard": [Shard(0)],
    "hsdp": [Replicate(), Shard(0)],
    "shard-shard": [Shard(0), Shard(0)],
}


def mesh_for(placements: Sequence[Placement]) -> DeviceMesh:
    return init_device_mesh(device().type, (1, 2) if len(placements) == 2 else (2,))


def dtensor_param(
    full: torch.Tensor,
    rows: Sequence[int],
    mesh: DeviceMesh,
    placements: Sequence[Placement],
    describe: bool = True,
) -> nn.Parameter:
    """``full`` as a parameter whose dim-0 rows are split ``rows[rank]`` per rank, as gradsync-fsdp lays
    out its optimizer params (with the chunk described on the local tensor)."""
    start = sum(rows[: dist.get_rank()])
    local = full[start : start + rows[dist.get_rank()]].clone()
    param = nn.Parameter(
        DTensor.from_local(local, mesh, placements, run_check=False, shape=full.shape, stride=full.stride())
    )
    if describe:
        describe_chunk(param, [start] + [0] * (full.dim() - 1))
    return param


def make_optimizer(name: str, params: list[nn.Parameter]) -> torch.optim.Optimizer:
    if name == "muon":  # the last param in an AdamW group
        groups = [{"params": params[:-1]}, {"params": params[-1:], "use_muon": False}]
        return Muon(groups, lr=0.05, weight_decay=0.1)
    return BlockShampoo(params, lr=0.05, block_size=(4, 3), eps=1e-6)


def lent_step(opt: torch.optim.Optimizer) -> None:
    """``opt.step()`` as gradsync-fsdp's ``fully_shard_optimizer`` runs it: on the DTensor params' local
    tensors (the same objects every step), with their grads and their state's local tensors."""
    originals = [group["params"] for group in opt.param_groups]
    lent = {}
    for group in opt.param_groups:
        for param in group["params"]:
            local = param._local_tensor
            local.grad = param.grad._local_tensor if param.grad is not None else None
            state = opt.state.pop(param, {})
            opt.state[local] = {k: v._local_tensor if isinstance(v, DTensor) else v for k, v in state.items()}
            lent[param] = state
        group["params"] = [param._local_tensor for param in group["params"]]
    try:
        opt.step()
    finally:
        for group, params in zip(opt.param_groups, originals, strict=True):
            group["params"] = params
        for param, state in lent.items():
            stepped = opt.state.pop(param._local_tensor)
            # materialised before, the (empty) state of a param this rank holds nothing of included
            assert stepped.keys() == state.keys()
            if state:
                opt.state[param] = state


def step_sharded(
    name: str, fulls: list[torch.Tensor], rows: list[list[int]], placements: list[Placement], lend: bool
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Step ``name`` over DTensor shards (lent as local tensors, after materialising the state, as
    gradsync-fsdp does, or not) and over whole plain tensors: (this rank's local, the same rows of the
    whole) per param."""
    mesh = mesh_for(placements)
    sharded = [dtensor_param(f, r, mesh, placements) for f, r in zip(fulls, rows, strict=True)]
    plain = [nn.Parameter(f.clone()) for f in fulls]
    opts = [make_optimizer(name, sharded), make_optimizer(name, plain)]
    if lend:
        materialize_optimizer_state(opts[0])
    for seed in range(3):
        torch.manual_seed(seed)
        for param, twin, r in zip(sharded, plain, rows, strict=True):
            twin.grad = torch.randn(twin.shape, device=device())
            param.grad = dtensor_param(twin.grad, r, mesh, placements).detach()
        if lend:
            lent_step(opts[0])
        else:
            opts[0].step()
        opts[1].step()
    out = []
    for param, twin, r in zip(sharded, plain, rows, strict=True):
        start = sum(r[: dist.get_rank()])
        out.append((param.to_local().detach().cpu(), twin.detach()[start : start + r[dist.get_rank()]].cpu()))
        holds = r[dist.get_rank()] > 0
        # both keep (empty) state where a rank holds nothing, as torch's optimizers do, materialised or not
        assert param in opts[0].state
        assert (
            all(local_tensor(v).numel() == 0 for v in opts[0].state.get(param, {}).values() if v.dim())
            or holds
        )
        for key, value in opts[0].state.get(param, {}).items():
            if key == "step":
                continue
            # laid out like the param, for the wrappers' checkpoints; tile stats in tiles, described
            assert isinstance(value, DTensor)
            if value.shape == param.shape:
                assert value.to_local().shape == param.to_local().shape
            else:
                assert hasattr(value._local_tensor, "__create_chunk_list__")
                tile_dim = 1 if param.dim() == 1 else 0  # a 1-D param is one row: sharded across tiles
                assert value.placements[-1] == Shard(tile_dim)
    return out


def step_whole_matrices_on_each_rank(
    name: str, placement: str, lend: bool
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    shapes = [(6, 4), (5, 5), (3, 2, 4), (6,)]
    fulls = [torch.randn(s, device=device()) for s in shapes]
    owners = [0, 1, 1, 0]  # each rank owns different whole params; the other holds none of their rows
    rows = [
        [s[0] if rank == owner else 0 for rank in range(2)] for s, owner in zip(shapes, owners, strict=True)
    ]
    if name == "shampoo":
        fulls.insert(0, torch.randn(8, 6, device=device()))
        rows.insert(0, [4, 4])  # cut on a tile boundary: each rank preconditions its own tiles
    return step_sharded(name, fulls, rows, PLACEMENTS[placement], lend)


@pytest.mark.parametrize(
    ("placement", "lend"), [("shard", False), ("shard", True), ("hsdp", False), ("shard-shard", False)]
)
@pytest.mark.parametrize("name", ["muon", "shampoo"])
def test_each_rank_steps_its_own_whole_params_like_one_process(name: str, placement: str, lend: bool) -> None:
    for results in run_distributed(step_whole_matrices_on_each_rank, 2, args=(name, placement, lend)):
        for local, expected in results:
            torch.testing.assert_close(local, expected, rtol=1e-6, atol=1e-7)


def refusal(case: str) -> str:
    """The ValueError a rank gets for a part that is not whole enough."""
    mesh = mesh_for([Shard(0)])
    full = torch.zeros(8, 6, device=device())
    param = dtensor_param(full, [3, 5], mesh, [Shard(0)], describe=case != "undescribed")
    param.grad = dtensor_param(full, [3, 5], mesh, [Shard(0)]).detach()
    try:
        if case == "muon":
            Muon([torch.zeros(2, 2), param])
        elif case == "shampoo-lent":
            lent_step(BlockShampoo([param], block_size=(4, 3)))
        elif case == "shampoo-lent-copy":  # a copy (pickling keeps only groups and state) still knows
            lent_step(copy.deepcopy(BlockShampoo([param], block_size=(4, 3))))
        else:
            BlockShampoo([param], block_size=(4, 3)).step()
    except ValueError as error:
        return str(error)
    return "no error"


@pytest.mark.parametrize(
    ("case", "needles"),
    [
        ("muon", ["Muon: param 1 of shape (8, 6) is cut on this rank", "shard_alignment='tensor'"]),
        ("shampoo", ["BlockShampoo: param 0 of shape (8, 6)", "shard_alignment='block:4x3'"]),
        ("shampoo-lent", ["BlockShampoo: param 0 of shape (8, 6)", "shard_alignment='block:4x3'"]),
        ("shampoo-lent-copy", ["BlockShampoo: param 0 of shape (8, 6)", "shard_alignment='block:4x3'"]),
        ("undescribed", ["is not torch.chunk's split", "describe_chunk"]),  # uneven, and nobody said where
    ],
)
def test_a_cut_matrix_is_refused_naming_the_fix(case: str, needles: list[str]) -> None:
    for message in run_distributed(refusal, 2, args=(case,)):
        assert all(needle in message for needle in needles), message


def describe_like_params(opt: torch.optim.Optimizer, first_rows: Sequence[int]) -> dict[str, Any]:
    """The optimizer's state dict with its param-shaped state described, as gradsync-fsdp does."""
    state_dict = opt.state_dict()
    params = [p for g in opt.param_groups for p in g["params"]]
    for index, entry in state_dict["state"].items():
        for value in entry.values():
            if value.shape == params[index].shape:
                describe_chunk(value, [first_rows[index]] + [0] * (value.dim() - 1))
    return state_dict


def reshard_through_dcp(directory: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """BlockShampoo state saved from one tile-aligned layout, loaded into another, steps on like an
    optimizer that never stopped (the plain twin)."""
    torch.manual_seed(0)
    fulls = [torch.randn(8, 6, device=device()), torch.randn(6, device=device())]
    plain = [nn.Parameter(f.clone()) for f in fulls]
    twin = make_optimizer("shampoo", plain)
    mesh = mesh_for([Shard(0)])
    out = []
    for layout, seeds in (([[4, 4], [3, 3]], range(2)), ([[8, 0], [6, 0]], range(2, 4))):
        sharded = [dtensor_param(p.detach(), r, mesh, [Shard(0)]) for p, r in zip(plain, layout, strict=True)]
        opt = make_optimizer("shampoo", sharded)
        first_rows = [sum(r[: dist.get_rank()]) for r in layout]
        if seeds[0]:
            materialize_optimizer_state(opt)
            state_dict = describe_like_params(opt, first_rows)
            dcp.load({"optim": state_dict}, checkpoint_id=directory)
            opt.load_state_dict(state_dict)
        for seed in seeds:
            torch.manual_seed(seed)
            for param, ref, r in zip(sharded, plain, layout, strict=True):
                ref.grad = torch.randn(ref.shape, device=device())
                param.grad = dtensor_param(ref.grad, r, mesh, [Shard(0)]).detach()
            opt.step()
            twin.step()
        if not seeds[0]:
            dcp.save({"optim": describe_like_params(opt, first_rows)}, checkpoint_id=directory)
    for param, ref, start, r in zip(sharded, plain, first_rows, layout, strict=True):
        out.append((param.to_local().detach().cpu(), ref.detach()[start : start + r[dist.get_rank()]].cpu()))
    return out


def test_block_shampoo_state_reshards_through_dcp_on_tile_boundaries(tmp_path: Any) -> None:
    for results in run_distributed(reshard_through_dcp, 2, args=(str(tmp_path),)):
        for local, expected in results:
            torch.testing.assert_close(local, expected, rtol=1e-6, atol=1e-7)


def test_a_part_marked_with_its_origin_is_checked_as_that_param() -> None:
    """gradsync-ddp's main params are plain tensors; the origin they carry (the whole param's shape and
    where the part starts) lets a matrix optimizer see a row piece for what it is."""
    from gradsync.buffers.matrix_optim import mark_param_origin

    rows = torch.nn.Parameter(torch.randn(4, 6))  # rows 4..7 of an 8 x 6 matrix
    rows.grad = torch.randn(4, 6)
    whole = torch.nn.Parameter(torch.randn(4, 6))
    whole.grad = torch.randn(4, 6)
    mark_param_origin(rows, torch.Size([8, 6]), (4, 0))
    mark_param_origin(whole, torch.Size([4, 6]), (0, 0))
    with pytest.raises(ValueError, match=r"is cut on this rank \(local shape \(4, 6\)\)"):
        Muon([rows]).step()
    Muon([whole]).step()  # a part that is the whole param steps
    with pytest.raises(ValueError, match="cut on this rank, which holds its rows 4 to 7, through its 3x6"):
        BlockShampoo([rows], block_size=(3, 6)).step()


TP_SHAPES = {"rows": ((8, 6), 0), "columns": ((6, 8), 1), "replicated": ((5, 4), None)}
"""A column-parallel weight (split along rows), a row-parallel one (along columns), one not split."""


def tp_shard(full: torch.Tensor, dim: int | None, rank: int, size: int) -> torch.Tensor:
    return full if dim is None else full.chunk(size, dim)[rank]


def tensor_parallel_muon(tp_mode: str, steps: int) -> dict[str, torch.Tensor]:
    """Five Muon steps on this rank's TP shards, the grads every rank's own slice of the same whole grads."""
    rank, size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    fulls = {name: torch.randn(shape) for name, (shape, _) in TP_SHAPES.items()}
    params = {}
    for name, (_, dim) in TP_SHAPES.items():
        param = nn.Parameter(tp_shard(fulls[name], dim, rank, size).clone().to(device()))
        if dim is not None:
            param.tensor_model_parallel = True  # type: ignore[attr-defined]
            param.partition_dim = dim  # type: ignore[attr-defined]
        params[name] = param
    optimizer = Muon(
        list(params.values()), lr=0.05, weight_decay=0.1, tp_group=dist.group.WORLD, tp_mode=tp_mode
    )
    for step in range(steps):
        torch.manual_seed(100 + step)
        for name, (shape, dim) in TP_SHAPES.items():
            params[name].grad = tp_shard(torch.randn(shape), dim, rank, size).to(device())
        optimizer.step()
    return {name: param.detach().cpu() for name, param in params.items()}


def one_process_muon(blockwise_over: int, steps: int) -> dict[str, torch.Tensor]:
    """The reference: Muon on the whole matrices, or (``blockwise_over`` ranks) on each TP shard as a
    matrix of its own; returns the whole matrices (shards concatenated)."""
    torch.manual_seed(0)
    fulls = {name: torch.randn(shape) for name, (shape, _) in TP_SHAPES.items()}
    pieces = {
        name: [
            nn.Parameter(p.clone()) for p in (full.chunk(blockwise_over, dim) if dim is not None else [full])
        ]
        for (name, full), (_, dim) in zip(fulls.items(), (d for d in TP_SHAPES.values()), strict=True)
    }
    optimizer = Muon([p for ps in pieces.values() for p in ps], lr=0.05, weight_decay=0.1)
    for step in range(steps):
        torch.manual_seed(100 + step)
        for name, (shape, dim) in TP_SHAPES.items():
            grad = torch.randn(shape)
            for piece, part in zip(pieces[name], grad.chunk(len(pieces[name]), dim or 0), strict=True):
                piece.grad = part
        optimizer.step()
    return {
        name: torch.cat([p.detach() for p in ps], dim if dim is not None else 0)
        for (name, ps), (_, dim) in zip(pieces.items(), TP_SHAPES.values(), strict=True)
    }


@pytest.mark.parametrize("tp_mode", ["duplicated", "blockwise"])
@pytest.mark.parametrize("world", [2, 4])
def test_muon_steps_tensor_parallel_shards_like_one_process(world: int, tp_mode: str) -> None:
    """``duplicated``: every TP rank's shard equals its part of one-process Muon on the whole matrix;
    ``blockwise``: of one-process Muon on each shard as a matrix of its own (which differs)."""
    want = one_process_muon(world if tp_mode == "blockwise" else 1, steps=5)
    for rank, got in enumerate(run_distributed(tensor_parallel_muon, world, args=(tp_mode, 5))):
        for name, (_, dim) in TP_SHAPES.items():
            expected = tp_shard(want[name], dim, rank, world)
            assert torch.allclose(got[name], expected, rtol=1e-5, atol=1e-6), (rank, name)


def test_tp_mode_and_split_dims_are_checked() -> None:
    with pytest.raises(ValueError, match="tp_mode must be one of duplicated, blockwise"):
        Muon([nn.Parameter(torch.zeros(2, 2))], tp_mode="gathered")


@pytest.mark.parametrize("shape", [(), (7,), (3, 4), (0, 3), (3, 0), (2, 0, 5), (1, 1, 1), (4, 6, 2)])
def test_contiguous_stride_is_torch_own(shape: tuple[int, ...]) -> None:
    """The strides DTensors built from shards are given (a 0-sized dim counts as 1, as torch's)."""
    assert contiguous_stride(shape) == torch.empty(shape).stride()
