"""A subset of the suite in the MPI world: run by CTest as
    mpiexec -np 4 python3 -m pytest tests/python/test_mpi.py
(every rank runs the same tests in the same order; each test is collective). Skipped outside
mpirun."""
import os

import pytest
import torch

import moed

pytestmark = pytest.mark.skipif("OMPI_COMM_WORLD_SIZE" not in os.environ, reason="needs mpirun")

KINDS = ["allgather", "alltoall", "flex"]


@pytest.fixture(scope="module")
def group():
    return moed.init(timeout=60)


def test_world(group):
    assert group.size() == int(os.environ["OMPI_COMM_WORLD_SIZE"]) and group.backend == "mpi"
    assert moed.dist.get_rank() == group.rank()


def test_dist(group):
    r, R = group.rank(), group.size()
    t = torch.full((4,), float(r + 1))
    moed.dist.all_reduce(t)
    assert torch.equal(t, torch.full((4,), float(R * (R + 1) // 2)))
    parts = [torch.empty(2, dtype=torch.int64) for _ in range(R)]
    moed.dist.all_gather(parts, torch.tensor([r, -r]))
    assert [p.tolist() for p in parts] == [[i, -i] for i in range(R)]
    b = torch.arange(3.0) if r == 0 else torch.zeros(3)
    moed.dist.broadcast(b, src=0)
    assert b.tolist() == [0.0, 1.0, 2.0]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dispatchers_match_reference(group, kind, dtype):
    from test_megatron import LAYOUTS, body, reference
    R, r = group.size(), group.rank()
    lay = LAYOUTS["cap1_probs"]
    got = body(group, kind, 40, 2, dtype, lay, True, False, False)
    disp, out, gx, gp = reference((R, 0), 40, 2, dtype, lay, True, False)
    assert torch.equal(got["ei"], disp[r]["expert_input"])
    assert torch.equal(got["out"], out[r])
    assert torch.equal(got["gx"], gx[r])
    assert torch.equal(got["gp"], gp[r])
    for key in ("ei", "pprobs", "tpe", "out", "gx", "gp"):
        assert torch.equal(got[key], got["cpp"][key])


@pytest.mark.parametrize("kind", KINDS)
def test_dispatch_into_callers_tensor(group, kind):
    from test_megatron import dispatch_out_body
    ok, errors, _ = dispatch_out_body(group, kind, torch.float32, 0, False)
    assert all(ok), ok
    assert len(errors) == 1 and f"rank {group.size() - 1}: out is" in errors[0], errors


@pytest.mark.parametrize("kind", KINDS)
def test_held_output_outlives_its_dispatcher(group, kind):
    from test_megatron import held_output_body
    assert held_output_body(group, kind)


def test_bad_input_every_rank(group):
    from moed.megatron import make_dispatcher
    with pytest.raises(ValueError, match="rank"):
        make_dispatcher("alltoall", num_moe_experts=group.size() + 1)


def test_example_trains(group):
    import importlib.util
    here = os.path.dirname(os.path.abspath(__file__))
    spec = importlib.util.spec_from_file_location(
        "moe_layer", os.path.join(here, "..", "..", "python", "examples", "moe_layer.py"))
    ex = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ex)
    losses = ex.train(group, "flex", 3)
    assert losses[-1] < losses[0]


def test_zz_failed_rank_raises_everywhere(group):
    # Last: after a failure the MPI world is unusable.
    if group.rank() == 1:
        group.handle.fail("rank 1 gave up")
        return
    with pytest.raises(moed.AbortedError, match="rank 1"):
        group.barrier()
