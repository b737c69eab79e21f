"""One launcher per test host (test_gloo_hosts.py runs it through scripts/hosts.sh, whose
mpirun serves only as the remote starter: one launcher per host, no MPI inside). It spawns
this host's processes with torch.multiprocessing.spawn; they join one torch.distributed gloo
group whose master is the first host's address on the test subnet, and run a gloo_workers
scenario. Each process's exit code goes to <out>/exit<rank>.txt.

    python3 gloo_hosts.py SCENARIO PER_HOST PORT OUT"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gloo_workers  # noqa: E402


def run():
    scenario, per_host, port, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    host = int(os.environ["OMPI_COMM_WORLD_RANK"])
    num_hosts = int(os.environ["OMPI_COMM_WORLD_SIZE"])
    master = os.environ["MOED_HOSTS"].split(",")[0].split(":")[0]
    os.environ["MASTER_ADDR"] = master  # moed listens on the address that routes to it
    # torch's own gloo group: a test host's name resolves nowhere, so name its interface.
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "eth0")
    os.environ["MOED_SHRINK_DIR"] = out  # the shrink scenarios' files
    size = num_hosts * per_host
    ctx = torch.multiprocessing.spawn(
        gloo_workers.main_on_host, nprocs=per_host, join=False,
        args=(host, per_host, size, master, port, scenario, 0, 60.0, out))
    for i, p in enumerate(ctx.processes):
        p.join(150)
        if p.is_alive():
            p.kill()
            p.join()
        with open(os.path.join(out, f"exit{host * per_host + i}.txt"), "w") as f:
            f.write(str(p.exitcode))


if __name__ == "__main__":
    run()
