"""The model-parallel config protocol accepts gradsync's dataclass and any Megatron-like object."""

from __future__ import annotations

from types import SimpleNamespace

from gradsync.groups import ModelParallelConfig, ModelParallelConfigProtocol


def read_scaling(config: ModelParallelConfigProtocol) -> bool:
    return config.calculate_per_token_loss


def test_dataclass_defaults_match_megatron() -> None:
    config = ModelParallelConfig()
    assert isinstance(config, ModelParallelConfigProtocol)
    assert config.sequence_parallel is False
    assert config.calculate_per_token_loss is False
    assert config.context_parallel_size == 1
    assert config.mtp_num_layers is None
    assert config.moe_router_load_balancing_type == "aux_loss"
    assert read_scaling(ModelParallelConfig(calculate_per_token_loss=True))


def test_a_megatron_like_object_satisfies_the_protocol() -> None:
    fields = {name: getattr(ModelParallelConfig(), name) for name in vars(ModelParallelConfig())}
    megatron_like = SimpleNamespace(**fields, num_attention_heads=8, hidden_size=64)
    assert isinstance(megatron_like, ModelParallelConfigProtocol)
    incomplete = SimpleNamespace(sequence_parallel=True)
    assert not isinstance(incomplete, ModelParallelConfigProtocol)
