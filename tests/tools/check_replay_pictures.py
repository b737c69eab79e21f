#!/usr/bin/env python3
"""`moed replay`'s pictures are well-formed SVG with titles, axis labels and legends.

Usage: check_replay_pictures.py MOED_BINARY WORK_DIR

Writes a skewed [steps, T, K] trace (plain Python, no NumPy needed), runs `moed replay` on it for
16 ranks in 2 nodes with a capacity factor, parses both SVGs with xml.etree and checks what a
reader needs to see. Exits non-zero with the reason on the first failure.
"""
import os
import random
import shutil
import struct
import subprocess
import sys
import xml.etree.ElementTree as ET

SVG = "{http://www.w3.org/2000/svg}"


def write_npy_i32(path, shape, values):
    header = "{'descr': '<i4', 'fortran_order': False, 'shape': (%s), }" % (
        "".join("%d, " % d for d in shape) if len(shape) == 1 else ", ".join(map(str, shape)))
    pad = 64 - (10 + len(header) + 1) % 64
    header += " " * (pad % 64) + "\n"
    with open(path, "wb") as f:
        f.write(b"\x93NUMPY\x01\x00" + struct.pack("<H", len(header)) + header.encode("latin1"))
        f.write(struct.pack("<%di" % len(values), *values))


def texts(root):
    return [("".join(t.itertext())).strip() for t in root.iter(SVG + "text")]


def check(cond, what):
    if not cond:
        sys.exit("check_replay_pictures: " + what)


def main():
    moed, work = sys.argv[1], sys.argv[2]
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    steps, tokens, topk, experts = 2, 512, 8, 256
    rng = random.Random(5)
    values = []
    for _ in range(steps * tokens):
        # Skewed: low expert ids are chosen more often, so some experts overflow the capacity.
        chosen = set()
        while len(chosen) < topk:
            chosen.add(min(int(rng.expovariate(1 / 60.0)), experts - 1))
        values += sorted(chosen)
    trace = os.path.join(work, "trace.npy")
    write_npy_i32(trace, (steps, tokens, topk), values)
    out = os.path.join(work, "pictures")
    run = subprocess.run([moed, "replay", "--trace", trace, "--experts", str(experts), "--ranks",
                          "16", "--ranks-per-node", "8", "--capacity-factor", "1.0", "--out", out],
                         capture_output=True, text=True)
    check(run.returncode == 0, "moed replay failed: " + run.stdout + run.stderr)
    check("Flex (two hops)" in run.stdout, "no scheme table in:\n" + run.stdout)

    heat = ET.parse(os.path.join(out, "traffic.svg")).getroot()
    check(heat.tag == SVG + "svg", "traffic.svg: root is %s, not svg" % heat.tag)
    t = texts(heat)
    for want in ["source rank", "destination rank", "tokens sent", "node boundary (8 ranks)",
                 "Dispatch traffic: tokens sent from rank to rank"]:
        check(want in t, "traffic.svg lacks the text %r (has %r)" % (want, t))
    check(any(g.tag == SVG + "linearGradient" for g in heat.iter()), "traffic.svg: no colour ramp")
    cells = [r for r in heat.iter(SVG + "rect") if r.find(SVG + "title") is not None]
    check(len(cells) == 16 * 16, "traffic.svg: %d cells, expected 256" % len(cells))
    check(all(str(i) in t for i in (0, 15)), "traffic.svg: rank tick labels 0 and 15 missing")

    load = ET.parse(os.path.join(out, "expert_load.svg")).getroot()
    t = texts(load)
    for want in ["expert", "tokens routed (token-expert pairs)", "legend", "tokens kept",
                 "Load per expert"]:
        check(want in t, "expert_load.svg lacks the text %r" % want)
    check(any(s.startswith("mean routed = ") for s in t), "expert_load.svg: no mean in the legend")
    check(any(s.startswith("dropped (") for s in t), "expert_load.svg: no dropped entry")
    ticks = [s for s in t if s.isdigit()]
    check("0" in ticks and "240" in ticks, "expert_load.svg: expert ticks 0..240 missing")
    check(len([s for s in t if s.isdigit() and int(s) % 16 == 0 and int(s) <= 240]) >= 16,
          "expert_load.svg: fewer than 16 expert tick labels")
    print("check_replay_pictures: traffic.svg and expert_load.svg are well-formed and labelled")


if __name__ == "__main__":
    main()
