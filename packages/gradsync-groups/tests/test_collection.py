"""ProcessGroupCollection mechanics: keyword-only, unknown names rejected, unset fields
read None, repr with sizes."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from gradsync.groups import ProcessGroupCollection

SPEC_FIELDS = [
    "tp",
    "pp",
    "mp",
    "embd",
    "pos_embd",
    "cp",
    "tp_cp",
    "hcp",
    "ep",
    "expt_tp",
    "tp_ep",
    "tp_ep_pp",
    "tp_ep_pp_with_egtp_remat",
    "tp_dp_cp",
    "dp",
    "dp_cp",
    "dp_cp_gtp_remat",
    "dp_cp_ag",
    "gtp_remat",
    "expt_gtp_remat",
    "expt_dp",
    "expt_dp_gtp_remat",
    "expt_dp_ag",
    "intra_dp_cp",
    "intra_expt_dp",
    "inter_dist_opt",
    "intra_dist_opt",
]


@dataclass
class FakeGroup:
    """Stands in for a ProcessGroup where only ``size()`` is read."""

    n: int

    def size(self) -> int:
        return self.n


def test_fields_are_the_reference_fields_in_declaration_order() -> None:
    assert ProcessGroupCollection.field_names() == tuple(SPEC_FIELDS)


def test_set_fields_read_back_and_unset_fields_read_none() -> None:
    tp, pp = FakeGroup(4), FakeGroup(2)
    pgs = ProcessGroupCollection(tp=tp, pp=pp)  # type: ignore[arg-type]
    assert pgs.tp is tp
    assert pgs.pp is pp
    assert pgs.cp is None
    assert hasattr(pgs, "dp_cp")
    assert "tp" in vars(pgs)
    assert "cp" not in vars(pgs)


def test_explicit_none_is_distinguishable_from_unset() -> None:
    pgs = ProcessGroupCollection(expt_dp=None)
    assert pgs.expt_dp is None
    assert "expt_dp" in vars(pgs)


def test_fields_can_be_assigned_after_construction() -> None:
    pgs = ProcessGroupCollection()
    dp = FakeGroup(8)
    pgs.dp = dp  # type: ignore[assignment]
    assert pgs.dp is dp
    assert pgs.dp_cp is None


def test_unknown_field_raises_naming_it() -> None:
    with pytest.raises(ValueError, match="Unknown attribute: foo"):
        ProcessGroupCollection(foo=FakeGroup(1))


def test_positional_arguments_are_rejected() -> None:
    with pytest.raises(TypeError):
        ProcessGroupCollection(FakeGroup(1))  # type: ignore[call-arg]


def test_unknown_attribute_read_raises_attribute_error() -> None:
    with pytest.raises(AttributeError, match="'ProcessGroupCollection' object has no attribute 'foo'"):
        _ = ProcessGroupCollection().foo


def test_repr_empty() -> None:
    assert repr(ProcessGroupCollection()) == "ProcessGroupCollection(empty)"
    assert repr(ProcessGroupCollection(tp=None)) == "ProcessGroupCollection(empty)"


def test_repr_shows_sizes_in_declaration_order_and_lists() -> None:
    pgs = ProcessGroupCollection(
        pp=FakeGroup(2),  # type: ignore[arg-type]
        tp=FakeGroup(4),  # type: ignore[arg-type]
        hcp=[FakeGroup(2), FakeGroup(4)],  # type: ignore[list-item]
        cp=None,
    )
    assert repr(pgs) == "ProcessGroupCollection(tp(4), pp(2), hcp([2, 4]))"


def test_hcp_holds_a_list_of_groups() -> None:
    a, b = FakeGroup(2), FakeGroup(2)
    pgs = ProcessGroupCollection(hcp=[a, b])  # type: ignore[list-item]
    assert isinstance(pgs.hcp, list)
    assert pgs.hcp[0] is a
    assert pgs.hcp[1] is b


def test_equality_compares_fields_and_instances_are_unhashable() -> None:
    g = FakeGroup(2)
    assert ProcessGroupCollection(tp=g) == ProcessGroupCollection(tp=g)  # type: ignore[arg-type]
    assert ProcessGroupCollection(tp=g) != ProcessGroupCollection(pp=g)  # type: ignore[arg-type]
    assert ProcessGroupCollection() == ProcessGroupCollection(tp=None)
    with pytest.raises(TypeError):
        hash(ProcessGroupCollection())
