"""The gloo world across 2 test hosts x 2 processes (scripts/hosts.sh: network namespaces,
TCP between hosts, shared memory inside one): one launcher per host (gloo_hosts.py), the master
address on the test subnet. The same checks as test_gloo.py: results bitwise equal to the
threads world's with 2 nodes of 2, a killed or raising rank ends every other rank with an
error naming it, and in shrink mode a cut link leaves each host's ranks going on. Needs root,
iproute2 and nftables (CTest runs it with label `hosts`, exit 77 = skip)."""
import os
import shutil
import subprocess
import tempfile

import pytest
import torch

import moed
import test_gloo

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))

pytestmark = [
    pytest.mark.skipif(not moed._C.has_gloo(), reason="moed built without gloo"),
    pytest.mark.skipif(os.geteuid() != 0 or shutil.which("ip") is None,
                       reason="needs root and iproute2 (network namespaces)"),
]


def run_hosts(scenario, hosts=2, per_host=2, files=()):
    out = tempfile.mkdtemp(prefix="moed-gloo-hosts-")
    os.chmod(out, 0o777)
    cmd = [os.path.join(ROOT, "scripts", "hosts.sh"), str(hosts), "1", "--timeout", "170", "--",
           "/usr/bin/python3", os.path.join(HERE, "gloo_hosts.py"), scenario, str(per_host),
           str(test_gloo.free_port()), out]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=200)
    size = hosts * per_host
    codes, recs = [], []
    for r in range(size):
        path = os.path.join(out, f"exit{r}.txt")
        codes.append(int(open(path).read()) if os.path.exists(path) else None)
        path = os.path.join(out, f"{r}.pt")
        recs.append(torch.load(path) if os.path.exists(path) else None)
    for name in files:
        with open(os.path.join(out, name)) as f:
            recs.append(f.read())
    shutil.rmtree(out, ignore_errors=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return codes, recs


def test_matches_threads_world_across_hosts():
    codes, recs = run_hosts("all")
    assert codes == [0] * 4, (codes, [r and r.get("error") for r in recs])
    want = test_gloo.threads_dispatchers(4, 2)
    for r, rec in enumerate(recs):
        assert rec["ok"], f"rank {r}: {rec['error']}"
        assert rec["nodes"] == 2  # found from the real hosts
        test_gloo.equal(rec["result"]["dispatchers"], want[r], f"rank {r} dispatchers")


@pytest.mark.parametrize("scenario", ["raise", "kill"])
def test_fault_across_hosts(scenario):
    codes, recs = run_hosts(scenario)
    assert codes[1] != 0, codes
    for r in (0, 2, 3):
        assert codes[r] == 0 and recs[r] is not None, (r, codes)
        err = recs[r]["error"] if not recs[r]["ok"] else "no error"
        assert err.startswith("AbortedError") and "rank 1" in err and "waited" not in err, (r, err)


def test_link_cut_each_host_goes_on():
    """Shrink mode across hosts: rank 1 cuts the link between the two hosts before step 4 of a
    decode loop; each host's ranks mask the other host's (one, then both: a message may reach
    a rank before the cut and not its node-mate), never their own host's, and finish every
    step, each step's output bitwise equal to the reference with the ranks it masked dropped,
    the first step without the other host within 2 shrink timeouts + 2 s of the cut (each wait
    has its own deadline, and a rank waits for the two lost ones in turn)."""
    import test_shrink
    import gloo_workers as gw
    codes, recs = run_hosts("shrink_cut", files=["fault_time"])
    fault = float(recs.pop())
    for r, rec in enumerate(recs):
        assert rec is not None and rec["ok"], (r, codes[r], rec and rec.get("error"))
        other = {2, 3} if r < 2 else {0, 1}
        steps = rec["result"]
        assert [s["step"] for s in steps] == list(range(gw.SHRINK_STEPS)), r
        seen = set()
        for s in steps:
            masked = {q for q in range(4) if s["mask"][q]}
            assert seen <= masked <= other, (r, s["step"], masked)
            assert not masked or s["step"] >= gw.SHRINK_FAULT_AT, (r, s["step"])
            seen = masked
            want = test_shrink.reference(s["step"], r, False, masked)
            assert torch.equal(want.view(torch.int16), s["out"].view(torch.int16)), (r, s["step"])
        assert seen == other, (r, seen)
        first = min(s["done"] for s in steps if s["mask"].any())
        bound = test_shrink.SHRINK_TIMEOUT + test_shrink.GO_ON_BOUND  # one more deadline than a kill
        assert first - fault <= bound, (r, first - fault)
