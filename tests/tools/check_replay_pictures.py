#!/usr/bin/env python3
"""`moed replay`'s and `moed plan --sweep`'s pictures are well-formed SVG with titles, axis
labels and legends.

Usage: check_replay_pictures.py MOED_BINARY WORK_DIR

Writes a skewed [steps, T, K] trace (plain Python, no NumPy needed), runs `moed replay` on it for
16 ranks in 2 nodes with a capacity factor, parses both SVGs with xml.etree and checks what a
reader needs to see; then the per-layer pictures of a Megatron-Core trace directory (JSONL written
here as RouterTracer writes it) and the sweep chart. Exits non-zero with the reason on the first
failure.
"""
import json
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
    check_layer_pictures(moed, work)
    check_sweep(moed, work)
    print("check_replay_pictures: traffic.svg, expert_load.svg, layer_load.svg, layer_traffic.svg "
          "and sweep.svg are well-formed and labelled")


def check_layer_pictures(moed, work):
    """3 decoder layers of a 4-rank step, 16 experts: a layers x experts and a layers x ranks map."""
    d = os.path.join(work, "megatron")
    os.makedirs(d)
    rng = random.Random(9)
    for rank in range(4):
        with open(os.path.join(d, "router_trace_rank%d.jsonl" % rank), "w") as f:
            for layer in range(1, 4):
                top = [sorted(rng.sample(range(16), 2)) for _ in range(32)]
                f.write(json.dumps({"step": 0, "stage": "pre_dispatch", "block": "decoder",
                                    "layer": layer, "rank": rank, "num_tokens": 32, "topk": 2,
                                    "top_indices": top}) + "\n")
    out = os.path.join(work, "layers")
    run = subprocess.run([moed, "replay", "--trace", d, "--experts", "16", "--ranks-per-node", "2",
                          "--out", out], capture_output=True, text=True)
    check(run.returncode == 0, "moed replay on a Megatron trace failed: " + run.stdout + run.stderr)
    for name, columns, axis in (("layer_load.svg", 16, "expert"), ("layer_traffic.svg", 4,
                                                                  "destination rank")):
        root = ET.parse(os.path.join(out, name)).getroot()
        t = texts(root)
        for want in [axis, "decoder layer 1", "decoder layer 3"]:
            check(want in t, "%s lacks the text %r (has %r)" % (name, want, t))
        cells = [r for r in root.iter(SVG + "rect") if r.find(SVG + "title") is not None]
        check(len(cells) == 3 * columns, "%s: %d cells, expected %d" % (name, len(cells), 3 * columns))


def check_sweep(moed, work):
    out = os.path.join(work, "sweep")
    run = subprocess.run([moed, "plan", "--cluster", "h800", "--tokens", "128", "--mode",
                          "low-latency", "--sweep", "ep=8,16,32,64", "--out", out],
                         capture_output=True, text=True)
    check(run.returncode == 0, "moed plan --sweep failed: " + run.stdout + run.stderr)
    root = ET.parse(os.path.join(out, "sweep.svg")).getroot()
    t = texts(root)
    for want in ["dispatch", "combine", "EP size (ranks)", "time per call (us)",
                 "flex: DeepEP normal, 2 hops", "low-latency: per (token, expert)",
                 "DeepEP V1 (deepep-ll)", "8", "64"]:
        check(want in t, "sweep.svg lacks the text %r (has %r)" % (want, t))
    lines = [p for p in root.iter(SVG + "path") if p.get("fill") == "none"]
    check(len(lines) == 2 * 5, "sweep.svg: %d lines, expected 5 algorithms x 2 panels" % len(lines))


if __name__ == "__main__":
    main()
