"""hvdcompress.transports.topology: which ranks share a node, the same on every rank:
the override (``HVDC_RANKS_PER_NODE`` / ``ranks_per_node``) that lets one machine play a
cluster, ranks that disagree on it (the same RankAgreementError on every rank), node
keys from the launchers (torchrun's ``GROUP_RANK``, Slurm's ``SLURM_NODEID``, the host
name), and the layout's arithmetic. torchrun across namespaces: tests/test_bench_cluster.py;
MPI: tests/mpi/test_topology.py."""

from __future__ import annotations

import pytest
import torch

from hvdcompress.errors import RankAgreementError
from hvdcompress.training.simulate import run_ranks
from hvdcompress.transports import topology
from hvdcompress.transports.topology import Topology


def test_the_override_makes_blocks_of_k_ranks_on_every_rank():
    got = run_ranks(6, lambda t: topology.detect(t, ranks_per_node=3))
    assert all(g == got[0] for g in got)
    top = got[0]
    assert top.nodes == ((0, 1, 2), (3, 4, 5)) and top.ranks_per_node == 3
    assert [top.node_of(r) for r in range(6)] == [0, 0, 0, 1, 1, 1]
    assert [top.local_rank(r) for r in range(6)] == [0, 1, 2, 0, 1, 2]
    assert top.peers(4) == (1, 4) and top.size == 6


def test_the_environment_override(monkeypatch):
    monkeypatch.setenv("HVDC_RANKS_PER_NODE", "2")
    assert run_ranks(4, topology.detect)[3].nodes == ((0, 1), (2, 3))
    monkeypatch.setenv("HVDC_RANKS_PER_NODE", "two")
    with pytest.raises(ValueError, match="HVDC_RANKS_PER_NODE must be an int >= 1, got 'two'"):
        run_ranks(2, topology.detect)


def test_ranks_that_disagree_on_the_override_get_the_same_error_on_every_rank():
    errors = []

    def rank(t):
        try:
            topology.detect(t, ranks_per_node=4 if t.rank == 3 else 2)
        except RankAgreementError as err:
            errors.append(str(err))
            return "raised"
        return "went on"

    assert run_ranks(4, rank) == ["raised"] * 4
    assert len(set(errors)) == 1 and "rank 3: 4" in errors[0] and "rank 0: 2" in errors[0]


@pytest.mark.parametrize("raw", ["abc", "0", "-1", "2.5"])
def test_a_bad_override_on_one_rank_is_reported_on_every_rank_naming_the_variable(raw):
    """Gathered before anything else: every rank raises the same error naming the rank and
    HVDC_RANKS_PER_NODE (not an internal argument), none waits in a collective."""
    errors = []

    def rank(t):
        import os

        try:
            if t.rank == 2:  # the simulated world shares os.environ: set it for one rank
                os.environ["HVDC_RANKS_PER_NODE"] = raw
                detected = topology.detect(t)
            else:
                detected = topology.detect(t, ranks_per_node=2)
        except ValueError as err:
            errors.append(str(err))
            return "raised"
        finally:
            os.environ.pop("HVDC_RANKS_PER_NODE", None)
        return detected

    assert run_ranks(4, rank) == ["raised"] * 4
    assert len(set(errors)) == 1, errors
    assert errors[0] == f"on rank(s) [2] of 4: HVDC_RANKS_PER_NODE must be an int >= 1, got {raw!r}"


def test_an_override_that_does_not_divide_the_ranks_is_refused():
    with pytest.raises(ValueError, match="does not divide the 4 ranks"):
        run_ranks(4, lambda t: topology.detect(t, ranks_per_node=3))
    with pytest.raises(ValueError, match="ranks_per_node must be an int >= 1"):
        run_ranks(2, lambda t: topology.detect(t, ranks_per_node=0))


def test_without_an_override_the_launchers_node_keys_decide(monkeypatch):
    monkeypatch.delenv("HVDC_RANKS_PER_NODE", raising=False)
    monkeypatch.delenv("SLURM_NODEID", raising=False)
    assert run_ranks(3, topology.detect)[0].nodes == ((0, 1, 2),)  # one host: one node
    monkeypatch.setenv("SLURM_NODEID", "5")
    assert run_ranks(2, lambda t: t.node_key())[0] == ("slurm", "5")


def test_node_keys_need_not_be_contiguous_and_uneven_nodes_have_no_k():
    top = Topology.from_keys(["a", "b", "a", "b"])
    assert top.nodes == ((0, 2), (1, 3)) and top.ranks_per_node == 2
    assert top.peers(2) == (2, 3)
    uneven = Topology.from_keys(["a", "a", "b"])
    assert uneven.ranks_per_node is None and uneven.peers(1) == (1,)


def test_torchruns_group_rank_names_the_node(monkeypatch):
    from hvdcompress.transports.torch_dist import TorchDistTransport

    monkeypatch.setenv("GROUP_RANK", "3")
    t = TorchDistTransport.__new__(TorchDistTransport)  # no process group needed for the key
    assert t.node_key() == ("torchrun", 3)
    monkeypatch.delenv("GROUP_RANK")
    assert t.node_key()[0] in ("host", "slurm")


def _sub_sums(t):
    intra = t.split(((0, 1), (2, 3)))
    cross = t.split(((0, 2), (1, 3)))
    a = intra.start_allreduce_sum(torch.tensor([float(t.rank)])).wait()
    b = cross.start_allreduce_sum(torch.tensor([float(t.rank)])).wait()
    return intra.rank, intra.size, float(a), cross.rank, float(b)


def test_split_gives_each_rank_the_transport_of_its_group():
    got = run_ranks(4, _sub_sums)
    assert got == [(0, 2, 1.0, 0, 2.0), (1, 2, 1.0, 0, 4.0), (0, 2, 5.0, 1, 2.0),
                   (1, 2, 5.0, 1, 4.0)]  # fmt: skip


def test_ranks_that_split_differently_get_the_same_error_and_no_rank_hangs():
    def rank(t):
        groups = ((0, 1), (2, 3)) if t.rank else ((0, 2), (1, 3))
        with pytest.raises(RankAgreementError, match="disagree on the groups of a split") as e:
            t.split(groups)
        return str(e.value)

    assert len(set(run_ranks(4, rank))) == 1
    with pytest.raises(ValueError, match="hold every rank once"):
        run_ranks(2, lambda t: t.split(((0,),)))


def test_a_rank_that_fails_inside_a_subworld_ends_the_others():
    def rank(t):
        sub = t.split(((0, 1), (2, 3)))
        if t.rank == 1:
            raise KeyError("rank 1 failed")
        return sub.start_allreduce_sum(torch.ones(1)).wait()  # rank 0 would wait for rank 1

    with pytest.raises(KeyError, match="rank 1 failed"):
        run_ranks(4, rank)
