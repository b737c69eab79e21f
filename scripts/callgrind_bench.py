#!/usr/bin/env python3
"""Instructions per byte moved, for each kernel of a `moed bench` command: a figure that does not
move with the machine's load (docs/benchmarks.md, "Instructions per byte").

    scripts/callgrind_bench.py build/bin/moed dispatch --dispatcher flex --ranks 2 --shape mixtral
    scripts/callgrind_bench.py build/bin/moed low-latency --ranks 4 --shape decode

The command runs once under `valgrind --tool=callgrind` with --iters 1. Each kernel's one
counted call (the call whose traffic the record reports) is bracketed by callgrind client
requests (bench/limit.h, callgrind_call): the counters are zeroed when every rank has arrived
and dumped under the kernel's name when every rank is done. The figure is the instructions (Ir)
inside callgrind_call on every rank's thread (the call and its own waits, from
callgrind_annotate --inclusive=yes), divided by the bytes the record's traffic model moves
(model_read_bytes + model_write_bytes + 2 x model_network_bytes), read from the same run's
--json-out. The dump's total is printed beside it and is not a measure of the call: valgrind
runs one thread at a time, and the rank threads outside the call poll while they wait, so the
total moved 10x between two runs of the same command. Needs valgrind and callgrind_annotate;
the threads world only (one process).
"""
import glob
import json
import os
import re
import subprocess
import sys
import tempfile


def in_call(path):
    """Ir inside moed::bench::callgrind_call (inclusive, summed over the threads that ran it)."""
    text = subprocess.run(["callgrind_annotate", "--inclusive=yes", "--threshold=100", path],
                          capture_output=True, text=True, check=True).stdout
    for line in text.splitlines():
        m = re.match(r"\s*([\d,]+) .*moed::bench::callgrind_call\(", line)
        if m:
            return int(m.group(1).replace(",", ""))
    return None


def dumps(directory):
    """{name: (Ir in the call, Ir of the whole dump)} of every dump written on a client request."""
    out = {}
    for path in glob.glob(os.path.join(directory, "callgrind.out.*")):
        name, ir = None, None
        with open(path) as f:
            for line in f:
                m = re.match(r"desc: Trigger: Client Request: (.*)", line)
                if m:
                    name = m.group(1).strip()
                m = re.match(r"(summary|totals): (\d+)", line)
                if m and ir is None:
                    ir = int(m.group(2))
        if name is not None and ir is not None:
            out[name] = (in_call(path), ir)
    return out


def names(r):
    """The names a record's counted call may have been dumped under (bench/*.cc traffic_of)."""
    if r.get("suite") == "alltoallv":
        return ["alltoallv"]
    d, p = r.get("dispatcher", ""), r.get("phase", "")
    return [f"{d} {p} {r.get('dtype', '')}", f"{d} {p}"]


def main(argv):
    if len(argv) < 3:
        sys.exit(__doc__)
    moed, command = argv[1], argv[2:]
    with tempfile.TemporaryDirectory(prefix="moed-callgrind-") as tmp:
        records_path = os.path.join(tmp, "records.json")
        cmd = ["valgrind", "--tool=callgrind", "--dump-instr=no",
               f"--callgrind-out-file={tmp}/callgrind.out.%p", moed, "bench", *command,
               "--iters", "1", "--json-out", records_path]
        print("$", " ".join(cmd), flush=True)
        proc = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if proc.returncode != 0:
            sys.exit(proc.stderr[-3000:])
        records = json.load(open(records_path))
        counted = dumps(tmp)
    print(f"{'kernel':34} {'in the call':>14} {'model bytes':>14} {'instr/byte':>10} "
          f"{'dump total':>14}")
    seen = set()
    for r in records:
        if "fraction_of_limit" not in r:
            continue  # a half of a call: no model of its own
        name = next((n for n in names(r) if n in counted), None)
        if name is None or name in seen:
            continue
        seen.add(name)
        moved = r["model_read_bytes"] + r["model_write_bytes"] + 2 * r["model_network_bytes"]
        label = f"{r['shape']} R={r.get('ranks', 1)} {name}"
        ir, total = counted[name]
        if ir is None:
            sys.exit(f"{name}: no moed::bench::callgrind_call in its dump")
        print(f"{label:34} {ir:14d} {moved:14.0f} {ir / moved:10.3f} {total:14d}")


if __name__ == "__main__":
    main(sys.argv)
