"""moed.deep_ep under mpirun -np 4 (one process per rank, 2 emulated nodes of 2): the same
cases as test_deep_ep.py, run collectively by every process (CTest: moed_deep_ep_python_mpi).
Not named test_*.py, so the threads-world pytest run does not collect it."""
import pytest
import torch

import moed
import test_deep_ep as cases


@pytest.fixture(scope="module")
def group():
    g = moed.init(ranks_per_node=2, timeout=120.0)
    assert g.size() == 4, "run under mpirun -np 4"
    return g


def test_normal(group):
    assert cases.case_normal(group, 8, 2, 100, 11)
    assert cases.case_normal(group, 8, 8, 36, 12)


def test_num_worst_tokens(group):
    assert cases.case_normal(group, 8, 3, 100, 3, 64, 4)


def test_fp8(group):
    assert cases.case_fp8(group, 11)


def test_held_recv_x(group):
    assert cases.case_held_recv(group, 8, 2, 64, 21)


@pytest.mark.parametrize("mode", ["bf16", "bf16_hook", "fp8_round_hook", "ue8m0"])
def test_low_latency(group, mode):
    use_fp8 = mode.startswith("fp8") or mode == "ue8m0"
    assert cases.case_low_latency(group, 6, 512, 8, 3, 9, use_fp8, use_fp8, mode == "ue8m0",
                                  mode.endswith("hook"))


def test_bad_inputs(group):
    errors = cases.case_bad_inputs(group)
    assert len(errors) == 4, errors
    assert "rank 3: topk_idx[2][1] = 999 is outside [-1, 8)" in errors[0]
    assert "rank 0: num_tokens_per_rank[0]" in errors[1]
    assert "num_worst_tokens = 1" in errors[2]
    want = "TypeError: x has dtype" if group.rank() == 3 else "ValueError: rank 3: x has dtype"
    assert errors[3].startswith(want), errors[3]


# Caller-owned outputs and low-latency argument errors (test_out_buffers.py's cases).
def test_out_buffers(group):
    import test_out_buffers as out_cases
    for dtype in (torch.bfloat16, torch.float32):
        errors = out_cases.case_normal_out(group, 8, 2, 100, 5, dtype)
        assert len(errors) == 2 and all(e.startswith("rank 3: out ") for e in errors), errors
        errors, W = out_cases.case_dispatch_out(group, 8, 2, 100, 6, dtype)
        assert len(errors) == 2 and f"rank 3: out is [{W + 1}, 100]" in errors[1], errors
    for hook_mode in (False, True):
        assert out_cases.case_low_latency_out(group, 4, 256, 8, 2, 3, hook_mode)
    errors = out_cases.case_low_latency_errors(group, 4, 256, 8, 2, 7)
    assert len(errors) == 8 and errors[5] == "same", errors  # float64 weights are converted
    assert all(e.startswith("ValueError: rank 3: ") for i, e in enumerate(errors) if i != 5), errors


# DeepEP V2's ElasticBuffer (test_elastic.py's cases), one process per rank.
@pytest.mark.parametrize("expand", [False, True], ids=["rank_major", "expanded"])
def test_elastic(group, expand):
    import test_elastic
    test_elastic.case_elastic(group, 8, 3, 256, 5, expand, 4 if expand else 1, None, True, True, True, 2)
    test_elastic.case_elastic(group, 8, 2, 512, 9, expand, 1, "ue8m0", False, False, True, 1)
